"""Rollout stores outside the controller (transport/redis_store.py,
transport/storage_store.py) and the controller's collector that drops their
payloads: against a real redis-server and a real directory."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import wait_for
from redis_server import redis_url  # noqa: F401  (a pytest fixture)

from phalanx.controller.collector import Collector
from phalanx.protocol.rl import Completion, RolloutPayload
from phalanx.transport.base import RolloutStore, new_ref, ref_time
from phalanx.transport.factory import open_store
from phalanx.transport.redis_store import RedisRolloutStore
from phalanx.transport.storage_store import StorageRolloutStore


def payload(i: int, version: int = 3) -> RolloutPayload:
    c = Completion(
        prompt_ids=[1, 2], token_ids=[3, 4], logprobs=[-0.5, -1e-05], finished=True, reward=0.25
    )
    return RolloutPayload(rollout_id=f"p{i}.0", version=version, completions=[c, c])


@pytest.fixture(params=["redis", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RolloutStore]:
    url = request.getfixturevalue("redis_url") if request.param == "redis" else f"file://{tmp_path}"
    s = open_store(url, f"job.{tmp_path.name}")
    yield s
    s.close()


def test_put_get_and_drop_by_ref(store: RolloutStore):
    refs = store.put([payload(i) for i in range(4)])
    assert len(set(refs)) == 4 and all(r.startswith(f"p{i}.0-") for i, r in enumerate(refs))
    again = store.put([payload(0)])  # the same rollout put twice: a ref of its own
    assert again[0] != refs[0]
    found, lost = store.get([refs[2], refs[0], "p9.0-1-gone"])
    assert found == {refs[2]: payload(2), refs[0]: payload(0)}
    assert lost == {"p9.0-1-gone": "payload_missing"}
    assert store.drop(refs[:2], "trained") == 2
    assert store.drop(refs[:2], "trained") == 0  # idempotent: counted once
    assert store.drop([again[0]], "duplicate") == 1
    assert sorted(store.refs()) == sorted(refs[2:])
    c = store.counts()
    assert (c["put"], c["held"], c["trained"], c["discarded"]) == (5, 2, 2, {"duplicate": 1})
    assert c["corrupt"] == 0


def test_a_damaged_payload_is_set_aside_and_counted(store: RolloutStore):
    good, bad = store.put([payload(1), payload(2)])
    if isinstance(store, RedisRolloutStore):
        key = f"{store.base}:p:{bad}"
        value = store.r.get(key)
        store.r.set(key, value[:-5] + b"xxxxx")  # bytes changed after the checksum
    else:
        assert isinstance(store, StorageRolloutStore)
        path = store._path(bad)
        blob = bytearray(store.fs.cat_file(path))
        blob[-3] ^= 0xFF
        store.fs.pipe_file(path, bytes(blob))
    found, lost = store.get([good, bad])
    assert list(found) == [good] and lost == {bad: "payload_corrupt"}
    assert bad not in store.refs()
    c = store.counts()
    assert c["corrupt"] == 1 and c["put"] == c["held"] + c["trained"] + c["corrupt"]


def test_refs_carry_their_time():
    ref = new_ref("p3.1", wall=1234.5)
    assert ref.startswith("p3.1-1234500-") and ref_time(ref) == 1234.5
    assert ref_time("p3.1") is None


def test_the_collector_drops_what_it_is_given_and_sweeps_orphans(store: RolloutStore):
    """Drops are made on the store and reported back; a payload no record refers to,
    older than the orphan age, is swept (a replica that died between put and submit)."""
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    swept: list[str] = []
    held = set()
    refs = store.put([payload(i) for i in range(6)])
    held.add(refs[5])  # the ledger still refers to this one
    c = Collector(lambda _: store, orphan_age_s=0.0, sweep_every_s=0.1, stop_timeout_s=5.0)
    try:
        c.start("job.run", swept.extend, loop, lambda: set(held))
        c.submit([(refs[0], "trained"), (refs[1], "trained"), (refs[2], "stale")])
        wait_for(lambda: set(swept) >= set(refs[:3]), 30, "the drops to be reported")
        # refs[3] and refs[4] are orphans (nothing refers to them): swept, not refs[5].
        wait_for(lambda: store.refs() == [refs[5]], 30, "the orphans to be swept")
        counts = store.counts()
        assert counts["trained"] == 2
        assert counts["discarded"] == {"orphan": 2, "stale": 1}
    finally:
        c.stop()
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)

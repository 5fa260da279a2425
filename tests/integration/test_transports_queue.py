"""The rollout-queue contract, run against every backend: Redis Streams (a real
``redis-server``), the storage spool on ``file://`` and on ``memory://``.

Ordering is not part of the contract. What is: no loss; no delivery of an id
after it was acked; redelivery after a lease expires (and after a nack); a
consumer killed between its lease and its ack loses nothing; a corrupt record
is quarantined and counted, never raised; producers and consumers in separate
processes together deliver every rollout exactly once.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys
import time
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from procs import child_env, wait_for
from redis_server import redis_url  # noqa: F401  (a pytest fixture)

from phalanx.transport.base import RolloutQueue
from phalanx.transport.redis_queue import RedisRolloutQueue
from phalanx.transport.spool import MAGIC, SpoolRolloutQueue, encode

WORKER = Path(__file__).with_name("queue_worker.py")
BACKENDS = ["redis", "file", "memory"]

Make = Callable[..., RolloutQueue]


class Backend:
    def __init__(self, kind: str, url: str, name: str):
        self.kind, self.url, self.name = kind, url, name

    def make(self, consumer: str = "c0", lease_s: float = 30.0) -> RolloutQueue:
        if self.kind == "redis":
            return RedisRolloutQueue(self.url, self.name, consumer, lease_s=lease_s)
        return SpoolRolloutQueue(self.url, consumer, lease_s=lease_s, poll_s=0.01)

    def spec(self, lease_s: float) -> str:
        kind = "redis" if self.kind == "redis" else "spool"
        return json.dumps({"kind": kind, "url": self.url, "name": self.name, "lease_s": lease_s})


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    name = f"t-{uuid.uuid4().hex[:10]}"
    if request.param == "redis":
        return Backend("redis", request.getfixturevalue("redis_url"), name)
    if request.param == "file":
        return Backend("file", f"file://{tmp_path}/spool", name)
    return Backend("memory", f"memory://{name}/spool", name)


def rollouts(ids: list[str]) -> list[dict[str, Any]]:
    return [{"rollout_id": r, "version": 1, "reward": 0.5, "completions": [[1, 2]]} for r in ids]


def drain(q: RolloutQueue, n: int = 10) -> list[str]:
    got: list[str] = []
    while ds := q.lease(n):
        got += [d.rollout_id for d in ds]
        q.ack(ds)
    return got


def test_no_loss_and_no_delivery_after_ack(backend: Backend):
    a, b = backend.make("a"), backend.make("b")
    ids = [f"p{i}.0" for i in range(40)]
    for k in range(0, 40, 8):
        a.put(rollouts(ids[k : k + 8]))
    assert a.pending() == 40
    seen: list[str] = []
    while True:  # two consumers in turn
        da, db = a.lease(3), b.lease(5)
        if not da and not db:
            break
        seen += [d.rollout_id for d in da + db]
        assert all(d.attempt == 1 for d in da + db)
        a.ack(da)
        b.ack(db)
    assert sorted(seen) == sorted(ids), "lost or duplicated"
    assert a.pending() == b.pending() == 0
    # A second put of acked ids is never delivered again.
    a.put(rollouts(ids[:5]))
    assert drain(b) == [] and drain(a) == []
    assert a.counts()["acked"] == 40


def test_duplicate_puts_are_delivered_once(backend: Backend):
    q = backend.make()
    first = q.put(rollouts(["p1.0", "p2.0"]))
    again = q.put(rollouts(["p2.0", "p3.0"]))
    assert first == ["p1.0", "p2.0"]
    if backend.kind == "redis":
        assert again == ["p3.0"]  # deduplicated at put
    assert sorted(drain(q)) == ["p1.0", "p2.0", "p3.0"]


def test_redelivery_after_lease_expiry_and_after_nack(backend: Backend):
    a, b = backend.make("a", lease_s=0.4), backend.make("b", lease_s=0.4)
    a.put(rollouts([f"p{i}.0" for i in range(6)]))
    held = a.lease(4)
    assert len(held) == 4
    assert {d.rollout_id for d in b.lease(10)}.isdisjoint({d.rollout_id for d in held})
    time.sleep(0.5)  # a's lease (and b's) expired: a is "dead"
    again = wait_for(lambda: b.lease(10), 5, "expired leases to be delivered again")
    assert {d.rollout_id for d in held} <= {d.rollout_id for d in again}
    assert all(d.attempt >= 2 for d in again)
    b.ack(again)
    a.ack(held)  # the late ack of a consumer whose lease expired: harmless
    assert a.pending() == 0 and drain(a) == []
    # A nack hands a rollout back without waiting for its deadline.
    a.put(rollouts(["p9.0"]))
    d = a.lease(1)
    a.nack(d)
    back = wait_for(lambda: b.lease(1), 5, "the nacked rollout")
    assert [x.rollout_id for x in back] == ["p9.0"]
    b.ack(back)


def test_discard_is_counted_with_its_reason(backend: Backend):
    q = backend.make()
    q.put(rollouts(["p1.0", "p2.0", "p3.0"]))
    ds = {d.rollout_id: d for d in q.lease(3)}
    q.discard([ds["p1.0"], ds["p2.0"]], "stale")
    q.ack([ds["p3.0"]])
    q.discard([ds["p1.0"]], "stale")  # idempotent
    c = q.counts()
    assert c["discarded"] == {"stale": 2} and c["acked"] == 1
    assert q.pending() == 0 and drain(q) == []


def _corrupt(backend: Backend, q: RolloutQueue) -> int:
    """Inject corrupt records next to good ones; returns how many are corrupt."""
    if isinstance(q, RedisRolloutQueue):
        q.r.xadd(q.stream, {"id": "p100.0", "data": b'{"rollout_id":"p100.0"}', "crc": "1"})
        q.r.xadd(
            q.stream, {"id": "p101.0", "data": b"{not json", "crc": str(zlib.crc32(b"{not json"))}
        )
        return 2
    assert isinstance(q, SpoolRolloutQueue)
    good = encode(rollouts(["p50.0"])[0])
    flipped = bytearray(encode(rollouts(["p51.0"])[0]))
    flipped[-3] ^= 0xFF  # a bit flip in the payload: checksum mismatch
    truncated = encode(rollouts(["p52.0"])[0])[:-7]  # a torn tail
    bad_len = bytearray(encode(rollouts(["p53.0"])[0]))
    struct.pack_into("<I", bad_len, len(MAGIC), 1 << 30)  # a length past the end
    blob = bytes(flipped) + good + bytes(bad_len) + encode(rollouts(["p54.0"])[0]) + truncated
    q.fs.pipe_file(f"{q.root}/segments/00000000000000000001-hand-000001.seg", blob)
    return 3


def test_corrupt_records_are_quarantined_and_counted(backend: Backend):
    q = backend.make()
    q.put(rollouts(["p1.0", "p2.0"]))
    bad = _corrupt(backend, q)
    got = drain(q)  # never raises
    assert {"p1.0", "p2.0"} <= set(got)
    assert not {"p100.0", "p101.0", "p51.0", "p52.0", "p53.0"} & set(got)
    if backend.kind != "redis":
        assert {"p50.0", "p54.0"} <= set(got)
    assert q.counts()["corrupt"] == bad
    assert q.pending() == 0


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )


def _lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")]


@pytest.mark.parametrize("backend", ["redis", "file"], indirect=True)
def test_consumer_killed_between_lease_and_ack_loses_nothing(backend: Backend):
    q = backend.make("survivor", lease_s=1.0)
    q.put(rollouts([f"p{i}.0" for i in range(10)]))
    p = _spawn("crash", backend.spec(1.0), "6")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 9, err
    leased = _lines(out)[0]["leased"]
    assert len(leased) == 6
    got = drain(q)
    assert not set(got) & set(leased), "delivered again before the lease expired"
    time.sleep(1.1)
    got += wait_for(lambda: drain(q), 10, "the dead consumer's rollouts")
    assert sorted(got) == sorted(f"p{i}.0" for i in range(10))


@pytest.mark.parametrize("backend", ["redis", "file"], indirect=True)
def test_producers_and_consumers_in_separate_processes(backend: Backend, tmp_path: Path):
    stop = tmp_path / "stop"
    spec = backend.spec(30.0)
    consumers = [_spawn("consume", spec, str(stop)) for _ in range(2)]
    producers = [_spawn("produce", spec, f"p{k}", "60", "7") for k in range(2)]
    try:
        puts = []
        for p in producers:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            puts += [r for e in _lines(out) for r in e["put"]]
        stop.touch()
        acked: list[str] = []
        for p in consumers:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            acked += [r for e in _lines(out) for r in e["acked"]]
    finally:
        for p in consumers + producers:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert len(puts) == 120
    assert sorted(acked) == sorted(puts), "each rollout must be delivered exactly once"
    assert backend.make().pending() == 0

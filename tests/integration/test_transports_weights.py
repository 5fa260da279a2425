"""Weight stores (storage on ``file://`` and ``memory://``, Redis on a real
``redis-server``) and the weight channel over them: versions, the latest,
waiting for a newer one, garbage collection, checksums, and a reader that
never sees a partial version while a publisher keeps publishing."""

from __future__ import annotations

import threading
import time
import uuid
from pathlib import Path

import pytest
import torch
from redis_server import redis_url  # noqa: F401  (a pytest fixture)

from phalanx.comm.base import CommError
from phalanx.transport.base import SyncOrder, SyncResult, WeightStore
from phalanx.transport.published import StoreWeightChannel
from phalanx.transport.redis_weights import RedisWeightStore
from phalanx.transport.storage_weights import StorageWeightStore


@pytest.fixture(params=["file", "memory", "redis"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path):
    name = f"w-{uuid.uuid4().hex[:10]}"

    def make(keep: int = 2) -> WeightStore:
        if request.param == "redis":
            return RedisWeightStore(request.getfixturevalue("redis_url"), name, keep=keep)
        root = f"file://{tmp_path}/weights" if request.param == "file" else f"memory://{name}"
        return StorageWeightStore(root, keep=keep)

    make.kind = request.param  # type: ignore[attr-defined]
    return make


def weights(v: int, n: int = 1000) -> dict[str, torch.Tensor]:
    w = torch.full((n,), float(v))
    # Tied tensors (as with tied embeddings) must survive the trip.
    return {"emb": w, "head": w, "bias": torch.full((3,), v, dtype=torch.int64)}


def test_publish_fetch_latest_and_wait_newer(make_store):
    pub, reader = make_store(), make_store()
    assert reader.latest() is None and reader.wait_newer(-1, 0.05) is None
    pub.publish(1, weights(1), {"seq": 7})
    pub.publish(2, weights(2), {"seq": 8})
    assert reader.latest() == (2, {"seq": 8})
    v, w = reader.fetch()
    assert v == 2 and torch.equal(w["emb"], torch.full((1000,), 2.0))
    assert reader.fetch(1)[1]["bias"].tolist() == [1, 1, 1]
    assert reader.wait_newer(2, 0.1) is None
    t = threading.Timer(0.2, lambda: pub.publish(3, weights(3), {"seq": 9}))
    t.start()
    t0 = time.monotonic()
    assert reader.wait_newer(2, 5.0) == (3, {"seq": 9})
    assert time.monotonic() - t0 < 3.0
    t.join()


def test_old_versions_are_collected(make_store, tmp_path: Path):
    s = make_store(keep=2)
    for v in range(1, 6):
        s.publish(v, weights(v))
    assert s.versions() == [4, 5]
    with pytest.raises(CommError, match="version 1 must be in"):
        s.fetch(1)
    assert s.fetch(4)[0] == 4
    if make_store.kind == "file":
        assert len(list((tmp_path / "weights").glob("*.safetensors"))) == 2


def test_a_reader_never_sees_a_partial_version(make_store):
    pub, reader = make_store(keep=2), make_store(keep=2)
    stop = threading.Event()
    errors: list[BaseException] = []

    def publish() -> None:
        try:
            for v in range(1, 41):
                pub.publish(v, weights(v, 50_000))
        except BaseException as e:
            errors.append(e)
        finally:
            stop.set()

    t = threading.Thread(target=publish)
    t.start()
    seen = set()
    while not stop.is_set() or not seen:
        try:
            v, w = reader.fetch()
        except CommError as e:
            assert "no weights published yet" in str(e)
            continue
        # Every tensor of a version holds that version: nothing mixed, nothing torn.
        assert all(bool((x == v).all()) for x in w.values()), v
        seen.add(v)
    t.join()
    assert not errors, errors
    assert reader.fetch()[0] == 40 and len(seen) >= 2


def test_a_damaged_file_fails_its_checksum(tmp_path: Path):
    s = StorageWeightStore(f"file://{tmp_path}/w")
    s.publish(1, weights(1))
    (f,) = (tmp_path / "w").glob("*.safetensors")
    blob = bytearray(f.read_bytes())
    blob[-5] ^= 0xFF
    f.write_bytes(bytes(blob))
    with pytest.raises(CommError, match="checksum"):
        s.fetch()


def test_store_channel_serves_sync_orders(make_store):
    leader = StoreWeightChannel(make_store(), timeout_s=2.0)
    follower = StoreWeightChannel(make_store(), timeout_s=0.5)
    reports: list[SyncResult] = []
    like = {k: torch.zeros_like(t) for k, t in weights(0).items()}
    order = SyncOrder(seq=3, mesh_id=1, members=("p", "r"), rank=0, store="")
    leader.publish(6, weights(6), order, reports.append)
    assert leader.pending is not None and leader.pending.result(10).ok
    v, w = follower.fetch(SyncOrder(seq=3, mesh_id=1, members=("p", "r"), rank=1, store=""), like)
    assert v == 6 and torch.equal(w["emb"], weights(6)["emb"])
    assert reports[0].ok and reports[0].version == 6 and reports[0].nbytes > 0
    # An order nobody publishes for times out with a CommError (the sync is ordered again).
    with pytest.raises(CommError, match="published no weights"):
        follower.fetch(SyncOrder(seq=4, mesh_id=1, members=("p", "r"), rank=1, store=""), like)
    with pytest.raises(CommError, match="must match this replica's model"):
        follower.fetch(order, {"emb": torch.zeros(3)})
    leader.close()
    follower.close()

"""Replay buffers (in memory, and Redis on a real ``redis-server``): the last N
rollouts, deduplicated by id, sampled uniformly."""

from __future__ import annotations

import random
import uuid

import pytest
from redis_server import redis_url  # noqa: F401  (a pytest fixture)

from phalanx.transport.base import ReplayBuffer
from phalanx.transport.replay import MemoryReplayBuffer, RedisReplayBuffer


@pytest.fixture(params=["memory", "redis"])
def make_buffer(request: pytest.FixtureRequest):
    name = f"r-{uuid.uuid4().hex[:10]}"
    shared: list[ReplayBuffer] = []

    def make(capacity: int) -> ReplayBuffer:
        if request.param == "redis":
            return RedisReplayBuffer(request.getfixturevalue("redis_url"), name, capacity)
        if not shared:  # one process: one buffer
            shared.append(MemoryReplayBuffer(capacity))
        return shared[0]

    return make


def rollouts(ids: range) -> list[dict]:
    return [{"rollout_id": f"p{i}.0", "reward": float(i)} for i in ids]


def test_holds_the_last_n_deduplicated(make_buffer):
    b = make_buffer(5)
    assert len(b) == 0 and b.sample(3) == []
    assert b.add(rollouts(range(3))) == 3
    assert b.add(rollouts(range(2, 8))) == 5  # p2 is already held
    assert len(b) == 5
    held = {r["rollout_id"] for r in make_buffer(5).sample(500, random.Random(0))}
    assert held == {f"p{i}.0" for i in range(3, 8)}


def test_sampling_is_uniform(make_buffer):
    b = make_buffer(4)
    b.add(rollouts(range(10)))
    got = [r["reward"] for r in b.sample(4000, random.Random(1))]
    counts = {v: got.count(v) for v in set(got)}
    assert set(counts) == {6.0, 7.0, 8.0, 9.0}
    assert all(800 <= c <= 1200 for c in counts.values()), counts


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        MemoryReplayBuffer(0)

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


def test_ranks_count_from_the_oldest_held_after_evictions(make_buffer):
    """entries_at(ranks) reads rank 0 as the oldest rollout held, in memory as on the
    server, however many times the ring has wrapped (the seeded draws read ranks)."""
    b = make_buffer(4)
    b.add(rollouts(range(11)))  # p7 .. p10 held, the ring wrapped twice
    got = b.entries_at([0, 2, 3])
    assert [r["rollout_id"] for r in got if r is not None] == ["p7.0", "p9.0", "p10.0"]


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        MemoryReplayBuffer(0)


def test_redis_samples_on_the_server_by_insertion_rank(redis_url):  # noqa: F811
    from phalanx.controller.core.base import ChangeLog
    from phalanx.controller.core.ledger.replay import ReplayBook, positions

    b = RedisReplayBuffer(redis_url, f"r-{uuid.uuid4().hex[:10]}", 6)
    docs = [
        {"rollout_id": f"p{i}.0", "prompt": i, "version": i // 2, "reward": 0.1 * i,
         "exact_match": 0.0, "completions": [{"token_ids": [i]}]}
        for i in range(9)
    ]  # fmt: skip
    assert b.add(docs[:4]) == 4 and b.add(docs[2:9]) == 5  # p2, p3 held already
    # The oldest three went (rank 0 is the oldest held); ranks follow insertion.
    assert b.size() == 6
    assert [e["rollout_id"] for e in b.entries_at([0, 5, 6])[:2]] == ["p3.0", "p8.0"]
    assert b.entries_at([6]) == [None]  # past the end
    assert b.entries_at([1])[0] == {
        k: docs[4][k] for k in ("rollout_id", "prompt", "version", "reward", "exact_match")
    }
    assert set(b.get(["p0.0", "p4.0"])) == {"p4.0"} and b.get(["p4.0"])["p4.0"] == docs[4]
    # The ledger's draw reads the same ranks as a memory replay holding the same ids.
    book = ReplayBook(ChangeLog(10), {}, lambda ref, why: None, kind="redis", capacity=6, seed=5)
    book.remote = b
    drawn = [e["rollout_id"] for e in book.draw(3, 2, book.size(0.0))]
    assert drawn == [f"p{3 + p}.0" for p in positions(5, 3, 6, 2)]
    b.close()


def test_the_controllers_writer_keeps_its_outbox_until_the_server_answers(
    redis_url,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
):
    import asyncio
    import socket

    from phalanx.controller import replay_writer
    from phalanx.controller.core.ledger import payload_key
    from phalanx.protocol.rl import Completion, RolloutPayload

    monkeypatch.setattr(replay_writer, "RETRY_S", 0.05)
    with socket.socket() as s:  # a port nothing listens on: a server that is down
        s.bind(("127.0.0.1", 0))
        down = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    name = f"w-{uuid.uuid4().hex[:10]}"
    comp = Completion(
        prompt_ids=[1], token_ids=[2, 3], logprobs=[-0.1, -0.2], finished=True, reward=1.0
    )
    payload = RolloutPayload(rollout_id="p0.0", version=3, completions=[comp])
    row = {"rollout_id": "p0.0", "prompt": 0, "version": 3, "reward": 1.0, "exact_match": 1.0}
    outbox = [row | {"ref": "p0.0"}]
    log = {payload_key("p0.0"): payload}
    live = RedisReplayBuffer(redis_url, name, 8)
    writer = replay_writer.ReplayWriter(
        RedisReplayBuffer(down, name, 8, timeout_s=0.5), log.get, None
    )
    said: list[str] = []

    async def scenario() -> list[str]:
        done: asyncio.Future[list[str]] = asyncio.get_running_loop().create_future()

        def unreachable(error: str) -> None:
            said.append(error)
            assert outbox, "the outbox is kept while the server is down"
            writer.replay = live  # the server is back

        task = asyncio.create_task(writer.run(lambda: outbox, done.set_result, unreachable))
        writer.wake.set()
        try:
            return await asyncio.wait_for(done, 30)
        finally:
            task.cancel()

    assert asyncio.run(scenario()) == ["p0.0"]
    assert len(said) == 1 and "redis replay" in said[0]
    # The payload as it was made (behaviour log-probs and version), with its summary.
    doc = live.get(["p0.0"])["p0.0"]
    assert (
        RolloutPayload.model_validate({k: doc[k] for k in ("rollout_id", "version", "completions")})
        == payload
    )
    assert live.entries_at([0]) == [row]
    live.close()


def test_a_draw_from_a_server_that_is_down_gives_up_soon_and_is_not_retried_at_once(caplog):
    import socket

    from phalanx.controller.core.base import ChangeLog
    from phalanx.controller.core.ledger.replay import RETRY_S, ReplayBook, ReplayUnavailable
    from phalanx.controller.replay_writer import DrawSource

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        down = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    book = ReplayBook(ChangeLog(10), {}, lambda ref, why: None, kind="redis", capacity=4, seed=0)
    book.remote = DrawSource(RedisReplayBuffer(down, "d", 4, timeout_s=0.5))
    with pytest.raises(ReplayUnavailable, match="redis replay"):
        book.size(10.0)
    assert "fresh rollouts only" in caplog.text and book.retry_at == 10.0 + RETRY_S
    caplog.clear()
    with pytest.raises(ReplayUnavailable, match="a moment ago"):
        book.size(10.0 + RETRY_S / 2)  # not asked again: the loop is not stalled twice
    assert caplog.text == ""


def test_a_policy_reads_replayed_payloads_by_id_and_reports_unreadable_ones(redis_url):  # noqa: F811
    import socket

    from phalanx.protocol.rl import Batch, BatchRollout, Completion, RolloutPayload
    from phalanx.transport.replay import replayed_payloads

    comp = Completion(prompt_ids=[1], token_ids=[2], logprobs=[-0.3], finished=True, reward=1.0)
    payload = RolloutPayload(rollout_id="p1.0", version=2, completions=[comp])
    live = RedisReplayBuffer(redis_url, f"r-{uuid.uuid4().hex[:10]}", 4)
    live.add([payload.model_dump(mode="json") | {"prompt": 1, "reward": 1.0, "exact_match": 1.0}])
    summary = {"prompt": 1, "version": 2, "reward": 1.0, "exact_match": 1.0, "replayed": True}
    rows = [BatchRollout(rollout_id=rid, **summary) for rid in ("p1.0", "p9.0")]
    fresh = BatchRollout(rollout_id="p5.0", prompt=5, version=2, reward=0.0, exact_match=0.0)
    batch = Batch(
        index=3, step=3, frozen_at=0.0, reward=0.0, exact_match=0.0, staleness=0,
        rollouts=[*rows, fresh],
    )  # fmt: skip
    assert replayed_payloads(batch, live) == {"p1.0": payload}  # p9.0 is not held: lost
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        down = RedisReplayBuffer(f"redis://127.0.0.1:{s.getsockname()[1]}/0", "d", 4, timeout_s=0.5)
    assert replayed_payloads(batch, down) == {}  # reported lost: the batch is drawn again
    live.close()

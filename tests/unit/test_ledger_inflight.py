"""Weight syncs that land during a generation: a rollout replica that registered
``inflight_updates`` is named in a sync order while it holds a lease, learns of it by
polling between chunks, and its rollouts then span two versions, the oldest of which
is what the ledger's staleness check measures."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from test_ledger import (
    PPS,
    R1,
    CheckedState,
    P,
    fill,
    form,
    job,
    lease,
    rollout,
    run_ahead,
    submit,
    train,
)

from phalanx.protocol.rl import Completion, RolloutIn


def join_inflight(st: CheckedState, name: str) -> str:
    m, _ = st.register(
        "rollout", name, "i0", now=0, wall=0, address=f"{name}-host:29500",
        capabilities={"inflight_updates": True},
    )  # fmt: skip
    return m.replica_id


def poll(st: CheckedState, rid: str, version: int, *, now: float = 0.0) -> dict[str, Any] | None:
    reply, _ = st._rl("sync_poll", rid, version, now=now, wall=now)
    return None if reply.sync is None else reply.sync.model_dump(mode="json")


def spanning(rid: str, oldest: int, newest: int, **kw: Any) -> dict[str, Any]:
    """A rollout whose completions' tokens run from version ``oldest`` to ``newest``."""
    r = rollout(rid, oldest, tokens=4, **kw)
    for c in r["completions"]:
        c["versions"] = [oldest, oldest, newest, newest]
    return r


def test_a_busy_replica_that_takes_updates_in_flight_joins_the_sync():
    st = job(rollouts=("r1",))
    r2 = join_inflight(st, "r2")
    form(st, [P])
    train(st, 0)
    fill(st, PPS, 1)
    held = lease(st, r2, 2, version=1)  # r2 is generating when the sync is due
    assert poll(st, r2, 1) is None  # nothing due yet
    st.lease_batch(P, 1, now=5, wall=5)
    st.ack_batch(P, 2, now=5, wall=5)
    sync = st.ledger.weights.sync
    assert sync is not None and sync.members == [P, R1, r2]  # busy, and named
    order = poll(st, r2, 1, now=6)
    assert order is not None and (order["seq"], order["rank"], order["ordered_at"]) == (1, 2, 5.0)
    for rid in (P, R1, r2):
        st.sync_done(rid, 1, 2, True, now=7, wall=7)
    assert st.ledger.weights.synced_version == 2 and poll(st, r2, 2) is None
    ids = [p["rollout_id"] for p in held["lease"]["prompts"]]
    out, _ = st.submit_rollouts(
        r2, held["lease"]["lease_id"], [spanning(x, 1, 2) for x in ids], now=8, wall=8
    )
    assert out["accepted"] == ids
    assert {st.ledger.rollouts.records[x]["version"] for x in ids} == {1}


def test_a_sync_that_waits_for_generation_says_when_its_version_was_published():
    """Without in-flight updates a busy replica is named only once it is idle again:
    its order comes after the publish, and ``published_at`` (the start of its
    ``sync_effect_s``) is the commit's time, not the order's."""
    st = job(rollouts=("r1",))
    form(st, [P])
    train(st, 0)
    fill(st, PPS, 1)
    held = lease(st, R1, 2, version=0)  # R1 generates when version 2 is published
    st.lease_batch(P, 1, now=5, wall=5)
    st.ack_batch(P, 2, now=5, wall=5)
    assert st.ledger.weights.sync is None  # R1 is busy and takes no update in flight
    ids = [p["rollout_id"] for p in held["lease"]["prompts"]]
    st.submit_rollouts(R1, held["lease"]["lease_id"], [rollout(x, 0) for x in ids], now=9, wall=9)
    reply = lease(st, R1, 0, version=0, now=9)
    assert reply["sync"] is not None
    assert (reply["sync"]["ordered_at"], reply["sync"]["published_at"]) == (9.0, 5.0)


def test_a_rollout_is_as_stale_as_its_oldest_token():
    """Tokens of version 0 and 2 in one rollout: with the floor at 1, it is stale, and
    counted under that reason as any stale rollout."""
    st = job("rl.loop.max_staleness=1", "rl.loop.max_ahead=1")
    run_ahead(st)
    form(st, [P])
    train(st, 0)
    held = lease(st, R1, 2, version=0)
    train(st, 1, 1)
    assert st.ledger.rollouts.floor() == 1
    ids = [p["rollout_id"] for p in held["lease"]["prompts"]]
    out, _ = st.submit_rollouts(
        R1, held["lease"]["lease_id"], [spanning(x, 0, 2) for x in ids], now=1, wall=1
    )
    assert out["stale"] == ids and not out["accepted"]
    assert st.ledger.rollouts.discarded["stale"] >= len(ids)


def test_a_plain_busy_replica_still_waits_for_its_lease_to_end():
    st = job(rollouts=("r1", "r2"))
    form(st, [P])
    train(st, 0)
    fill(st, PPS, 1)
    lease(st, "r2:i0", 2, version=1)
    st.lease_batch(P, 1, now=0, wall=0)
    st.ack_batch(P, 2, now=0, wall=0)
    assert st.ledger.weights.sync.members == [P, R1]
    assert poll(st, "r2:i0", 1) is None
    assert submit(st, "r2:i0", "L3", ["p8.0", "p9.0"], 1)["accepted"] == ["p8.0", "p9.0"]


@pytest.mark.parametrize(
    ("versions", "match"),
    [([1, 2], "one per token"), ([2, 1, 1], "non-decreasing")],
)
def test_completion_versions_are_checked_on_the_wire(versions, match):
    with pytest.raises(ValidationError, match=match):
        Completion(
            prompt_ids=[1],
            token_ids=[3, 4, 5],
            logprobs=[-1.0] * 3,
            finished=True,
            reward=0,
            versions=versions,
        )


def test_a_rollout_may_not_be_newer_than_its_oldest_token():
    r = spanning("p0.0", 1, 2)
    assert RolloutIn.model_validate(r).version == 1
    with pytest.raises(ValidationError, match="oldest of its tokens"):
        RolloutIn.model_validate({**r, "version": 2})

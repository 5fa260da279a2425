"""The ledger under RL over DiLoCo (docs/architecture.md, "RL over DiLoCo"): each
slot asks for a batch index of its own (``BatchLeaseReq.batch``), in whatever order
the slots come, and its ask carries the version its θ_global holds."""

from __future__ import annotations

from test_ledger import P2, PPS, P, check, fill, job, kinds


def test_a_slot_asking_ahead_freezes_the_indices_below_it_in_order():
    st = job(policies=("p1", "p2"))
    first = fill(st, PPS)
    second = fill(st, PPS)
    # Slot 1 asks for its batch 1 before slot 0 asks for batch 0.
    b1, _ = st.lease_batch(P2, 0, now=0, wall=0, batch=1)
    assert b1["batch"]["index"] == 1
    assert [r["rollout_id"] for r in b1["batch"]["rollouts"]] == second
    b0, _ = st.lease_batch(P, 0, now=0, wall=0, batch=0)
    assert [r["rollout_id"] for r in b0["batch"]["rollouts"]] == first
    assert "rollback" not in kinds(st)
    # Asked again (a restarted slot), each index is the same frozen batch.
    again, _ = st.lease_batch(P2, 0, now=1, wall=1, batch=1)
    assert again["batch"] == b1["batch"]
    check(st)


def test_an_ask_ahead_waits_until_every_index_below_it_can_be_frozen():
    st = job(policies=("p1", "p2"))
    first = fill(st, PPS)
    b1, _ = st.lease_batch(P2, 0, now=0, wall=0, batch=1)
    assert b1["batch"] is None  # batch 0 is frozen, too few rollouts are left for 1
    second = fill(st, PPS)
    b1, _ = st.lease_batch(P2, 0, now=0, wall=0, batch=1)
    assert [r["rollout_id"] for r in b1["batch"]["rollouts"]] == second
    b0, _ = st.lease_batch(P, 0, now=0, wall=0, batch=0)
    assert [r["rollout_id"] for r in b0["batch"]["rollouts"]] == first
    check(st)


def test_the_version_an_ask_carries_marks_the_rounds_below_it_trained():
    st = job(policies=("p1", "p2"))
    for _ in range(2):
        fill(st, PPS)
    for b, who in ((1, P2), (0, P)):
        st.lease_batch(who, 0, now=0, wall=0, batch=b)
    fill(st, PPS)
    # A round of 2 batches committed: the next ask carries version 2 (its ack lost).
    reply, _ = st.lease_batch(P, 2, now=1, wall=1, batch=2)
    assert reply["batch"]["index"] == 2
    check(st)
    assert st.ledger is not None
    assert st.ledger.policy_step == 2 and st.ledger.counts["trained_rollouts"] == 2 * PPS

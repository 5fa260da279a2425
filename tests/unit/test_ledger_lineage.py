"""The RL ledger follows the job's lineage (issue 34): "trained" means "in the lineage
of the final model". A rollback, made by quorum formation when no replica and no
checkpoint holds the job's step any more, takes back every batch trained past the
step it went back to: its prompts are issued again and its rollouts counted as
``rolled_back``. And the job's last step is decided at the commit that reaches it,
so that every policy replica stops on it; it is finished once a save holds it.

Every call goes through test_ledger's :class:`CheckedState` (the balance and the
journal checked after each call)."""

from __future__ import annotations

from test_ledger import PPS, R1, P, check, fill, job, join, rollout, train

from phalanx.protocol.rl import parse_rollout_id

WAIT_S = 3.0


def trained_prompts(st) -> list[int]:
    return sorted(
        parse_rollout_id(rid)[0]
        for ids in st.ledger.rollouts.lineage.batches.values()
        for rid in ids
    )


def test_a_rollback_takes_back_what_was_trained_past_it():
    st = job(f"timeouts.lost_step_wait_s={WAIT_S}", "rl.loop.sync_every=1")
    q, _ = st.request_quorum(P, 0, "a", 60.0, now=0, wall=0)
    assert q is not None
    batches = [train(st, step) for step in range(3)]
    # The commit of step 3 reached the controller with the policy's last quorum request.
    st.request_quorum(P, 3, "b", 60.0, now=1, wall=1)
    assert st.roles["policy"].step == 3 and len(trained_prompts(st)) == 3 * PPS
    pending = fill(st, PPS, 3)  # a batch's worth of rollouts, waiting
    st.deregister(P, "killed", now=2, wall=2)
    # Its only checkpoint root is gone too: a new replica starts from step 1 (say, a
    # copy of an old checkpoint). Its round waits, then the job rolls back.
    p2 = join(st, "policy", "p9")
    assert st.request_quorum(p2, 1, "c", 60.0, now=3, wall=3)[0] is None
    (rolled,) = st.tick(now=3 + WAIT_S, wall=9).formed
    assert (rolled.rolled_back_from, rolled.max_step) == (3, 1)
    (ev,) = [e for e in st.events if e["kind"] == "rollback"]
    assert (ev["from_step"], ev["to_step"]) == (3, 1)
    assert (ev["batches"], ev["prompts"]) == (2, 2 * PPS)
    led = st.ledger
    # Batch 0 stays in the lineage; batches 1 and 2 left it. Their prompts are queued
    # again under a new attempt, their rollouts discarded as rolled back.
    assert trained_prompts(st) == sorted(r["prompt"] for r in batches[0]["rollouts"])
    again = [r["prompt"] for b in batches[1:] for r in b["rollouts"]]
    assert sorted(led.prompts.requeue) == sorted(again)
    assert {led.prompts.by_index[i].rollout_id for i in again} == {f"p{i}.1" for i in again}
    assert led.rollouts.discarded == {"rolled_back": 2 * PPS}
    assert [h["batch"] for h in led.rollouts.history] == [0]
    assert (led.policy_step, led.rollouts.next_batch, led.weights.want_version) == (1, 1, 1)
    b = check(st)
    assert b["prompts"]["trained"] == b["rollouts"]["trained"] == PPS
    # The job goes on from step 1: the waiting rollouts make its next batch, and the
    # prompts taken back are leased first.
    reply, _ = st.lease_batch(p2, 1, now=10, wall=10)
    assert [r["rollout_id"] for r in reply["batch"]["rollouts"]] == pending
    lease, _ = st.lease_prompts(R1, 1, PPS, now=10, wall=10)
    assert [p["index"] for p in lease["lease"]["prompts"]] == again[:PPS]
    # A late copy of a rolled-back attempt is a duplicate.
    out, _ = st.submit_rollouts(R1, "L1", [rollout(f"p{again[-1]}.0", 2)], now=11, wall=11)
    assert out["duplicate"] == [f"p{again[-1]}.0"]
    assert check(st)["ok"]


def test_every_replica_stops_at_the_last_step_and_the_job_finishes_once_it_is_durable():
    st = job("rl.grpo.steps=2", policies=("p1", "p2"))
    train(st, 0)
    fill(st, PPS)
    st.lease_batch(P, 1, now=0, wall=0, durable=1)
    # The commit of the last batch (step 2) decides the end, before any save holds it.
    reply, tick = st.ack_batch(P, 2, now=1, wall=1, durable=1)
    assert (reply["final_step"], reply["finished"]) == (2, False)
    assert "p2:i0" in tick.ledger_for  # the other replica's ask learns of it at once
    # No batch is frozen past it, whoever asks: every replica ends on step 2.
    fill(st, PPS)
    r2, _ = st.lease_batch("p2:i0", 2, now=2, wall=2, durable=1)
    assert r2["batch"] is None and r2["final_step"] == 2 and not r2["finished"]
    assert 2 not in st.ledger.rollouts.batches
    # The save of step 2 commits: finished.
    done, _ = st.ack_batch(P, 2, now=3, wall=3, durable=2)
    assert done["finished"] and st.ledger.finished
    kinds = [e["kind"] for e in st.events]
    assert kinds.index("rl_final_step") < kinds.index("rl_finished")
    assert check(st)["prompts"]["trained"] == 2 * PPS


def test_a_target_met_by_a_lineage_that_is_rolled_back_is_forgotten():
    st = job(f"timeouts.lost_step_wait_s={WAIT_S}", "rl.loop.window=1")
    st.request_quorum(P, 0, "a", 60.0, now=0, wall=0)
    train(st, 0, exact_match=0.2)
    fill(st, PPS, 1, exact_match=1.0)
    st.lease_batch(P, 1, now=0, wall=0, durable=1)
    st.ack_batch(P, 2, now=0, wall=0, durable=1)  # committed, its save still running
    assert st.ledger.final_step == 2 and not st.ledger.finished
    st.request_quorum(P, 2, "b", 60.0, now=1, wall=1)
    st.deregister(P, "killed before the save of step 2", now=2, wall=2)
    p2 = join(st, "policy", "p9")
    st.request_quorum(p2, 1, "c", 60.0, now=3, wall=3)
    st.tick(now=3 + WAIT_S, wall=9)
    # Step 2 was never durable: its batch stays frozen, to be trained again; the end
    # it decided is gone with it, and nothing was counted as trained past step 1.
    assert st.ledger.final_step is None and not st.ledger.finished
    assert 1 in st.ledger.rollouts.batches and "trained_at" not in st.ledger.rollouts.batches[1]
    assert [h["batch"] for h in st.ledger.rollouts.history] == [0]
    assert st.ledger.rollouts.discarded == {}
    reply, _ = st.lease_batch(p2, 1, now=10, wall=10)
    assert reply["batch"]["index"] == 1

"""The ledger's replay memory (``rl.loop.replay_ratio``): trained rollouts kept, and
a share of each batch drawn from them once, at its freeze, from (job seed, batch
index) alone, so every replica and every retry trains the same batch.

Every call goes through test_ledger's :class:`CheckedState` (the balance and the
journal checked after each call)."""

from __future__ import annotations

import pytest
from test_ledger import P2, PPS, P, check, fill, job, restart

from phalanx.config import ConfigError
from phalanx.config.rl import load_rl_config
from phalanx.controller.core.base import Tick
from phalanx.controller.core.ledger import payload_key
from phalanx.controller.core.ledger.replay import positions
from phalanx.controller.journal import SqliteJournal as Journal

MEMORY = ("rl.transport.replay=memory", "rl.loop.replay_ratio=0.5")
REDIS_DOWN = ("rl.transport.replay=redis://127.0.0.1:1/0", "rl.loop.replay_ratio=0.5")
K = round(0.5 * PPS)
"""Rollouts each batch draws from the replay."""


def ask(st, step: int, *, policy: str = P, now: float = 0.0):
    reply, _ = st.lease_batch(policy, step, now=now, wall=now)
    return reply["batch"]


def batch_step(st, step: int, *, now: float = 0.0):
    """Fill the fresh share of batch ``step``, freeze it, commit and ack ``step + 1``."""
    fresh = len(st.ledger.rollouts.pending)
    need = PPS - (min(K, len(st.ledger.replay.entries)) if st.ledger.replay.entries else 0)
    if fresh < need:
        fill(st, need - fresh, step, now=now)
    batch = ask(st, step, now=now)
    assert batch is not None
    st.ack_batch(P, step + 1, now=now, wall=now)
    return batch


def split(batch) -> tuple[list[str], list[str]]:
    fresh = [r["rollout_id"] for r in batch["rollouts"] if not r["replayed"]]
    again = [r["rollout_id"] for r in batch["rollouts"] if r["replayed"]]
    return fresh, again


def test_replay_ratio_needs_a_replay_to_draw_from():
    with pytest.raises(ConfigError, match=r"rl.loop.replay_ratio needs rl.transport.replay"):
        load_rl_config(overrides=["loop.replay_ratio=0.5"])
    with pytest.raises(ConfigError, match="replay_ratio"):
        load_rl_config(overrides=["transport.replay=memory", "loop.replay_ratio=1.0"])
    # A replay with nothing drawn from it yet is filled all the same (for a later run).
    assert load_rl_config(overrides=["transport.replay=memory"]).loop.replay_ratio == 0


def test_positions_are_distinct_and_follow_seed_and_index():
    assert positions(0, 1, 10, 3) == positions(0, 1, 10, 3)
    draws = {tuple(positions(s, b, 10, 3)) for s in range(3) for b in range(5)}
    assert len(draws) > 10  # seed and index both move the draw
    assert all(len(set(d)) == 3 and all(0 <= p < 10 for p in d) for d in draws)
    assert positions(0, 0, 2, 5) == [0, 1]  # never more than the replay holds


def test_a_batch_draws_its_replayed_share_once_for_every_replica():
    st = job(*MEMORY, policies=("p1", "p2"))
    first = batch_step(st, 0)
    assert split(first)[1] == [] and len(st.ledger.replay.entries) == PPS  # trained: kept
    # Their payloads stay in the payload log (the memory replay's store).
    assert all(payload_key(r) in st.payloads for r in split(first)[0])
    fill(st, PPS - K, 1)
    b1 = ask(st, 1)
    fresh, again = split(b1)
    assert len(fresh) == PPS - K and len(again) == K
    held = list(st.ledger.replay.entries)
    assert again == [held[p] for p in positions(0, 1, len(held), K)]
    # Replayed rollouts come with their payloads, as they were made.
    for r in b1["rollouts"]:
        assert len(r["completions"]) == 2 and r["completions"][0]["logprobs"]
    # The other replica, and a retry of the step, get the very same batch.
    assert ask(st, 1, policy=P2) == b1 and ask(st, 1) == b1
    b = check(st)
    assert b["replay"]["batched"] == K and b["replay"]["replayed"] == 0
    st.ack_batch(P, 2, now=0, wall=0)
    b = check(st)
    assert (b["rollouts"]["trained"], b["rollouts"]["accepted"]) == (2 * PPS - K, 2 * PPS - K)
    assert (b["replay"]["replayed"], b["replay"]["batched"], b["replay"]["held"]) == (K, 0, 6)
    assert st.ledger.rollouts.history[-1]["batch"] == 1


def test_the_draw_depends_on_the_job_seed_and_the_batch_only():
    def run(seed: int) -> list[list[str]]:
        st = job(*MEMORY, f"job.seed={seed}")
        return [split(batch_step(st, step))[1] for step in range(6)]

    assert run(3) == run(3)
    assert run(3) != run(4)


def test_a_memory_replay_survives_a_controller_restart(tmp_path):
    journal = Journal(tmp_path / "j.sqlite")
    st = job(*MEMORY, journal=journal)
    batch_step(st, 0)
    fill(st, PPS - K, 1)
    st = restart(st, journal, now=1)
    assert len(st.ledger.replay.entries) == PPS
    # Payloads the replay holds are what the journal refers to (kept at a restart).
    assert {payload_key(r["ref"]) for r in st.ledger.replay.entries.values()} <= st.payload_keys()
    b1 = ask(st, 1, now=1)
    held = list(st.ledger.replay.entries)
    assert split(b1)[1] == [held[p] for p in positions(0, 1, PPS, K)]
    st = restart(st, journal, now=2)
    assert ask(st, 1, now=2) == b1  # frozen and journaled: the same after a restart
    journal.close()


def test_the_replay_keeps_the_last_n_and_never_evicts_a_drawn_entry():
    st = job(*MEMORY, "rl.transport.replay_size=4")
    batch_step(st, 0)
    fill(st, PPS - K, 1)
    ask(st, 1)
    fill(st, PPS - K, 2)  # batch 2's share waits while batch 1 trains
    st.ledger.rollouts.batch_for(2, wall=0)  # frozen ahead: its draw is pinned
    st.ack_batch(P, 2, now=0, wall=0)
    held, pinned = st.ledger.replay.entries, st.ledger.rollouts.pinned()
    assert len(pinned) == K and pinned <= set(held) and len(held) <= 4 + K
    evicted = st.ledger.counts["replay_evicted"]
    assert evicted == PPS + (PPS - K) - len(held)
    assert len([k for k in st.payloads if k.startswith("rl/")]) == len(held) + len(
        st.ledger.rollouts.records
    )
    check(st)


def test_a_lost_replayed_payload_redraws_the_batch():
    st = job(*MEMORY)
    batch_step(st, 0)
    fill(st, PPS, 1)
    _, again = split(ask(st, 1))
    out, _ = st.lost_payloads(P, [(again[0], "payload_missing")], now=1, wall=1)
    assert out["reopened"] == [1] and again[0] not in st.ledger.replay.entries
    b = ask(st, 1, now=1)
    assert again[0] not in split(b)[1] and len(b["rollouts"]) == PPS
    assert check(st)["replay"]["lost"] == 1


def test_an_unreachable_redis_replay_freezes_fresh_only_and_keeps_what_was_trained():
    st = job(*REDIS_DOWN)
    fill(st, PPS - K, 0)
    assert ask(st, 0) is None  # too few fresh ones even for a full draw: wait
    fill(st, K, 0)
    b0 = ask(st, 0)  # nothing attached (no server): fresh only, said and counted
    assert split(b0)[1] == [] and len(b0["rollouts"]) == PPS
    assert "replay_unavailable" in [e["kind"] for e in st.events]
    assert check(st)["replay"]["unavailable"] == 1
    st.ack_batch(P, 1, now=0, wall=0)
    # Trained, owed to the replay: journaled with their payloads kept until written.
    out = st.ledger.replay.outbox()
    assert len(out) == PPS and all(payload_key(r["ref"]) in st.payloads for r in out)
    st.ledger.replay.written([r["rollout_id"] for r in out])
    st.commit(st.ledger.take(Tick()))
    assert st.ledger.replay.out == {} and not [k for k in st.payloads if k.startswith("rl/")]
    check(st)


def test_a_replay_entry_whose_payload_the_log_lost_leaves_the_replay_at_a_restart(tmp_path):
    journal = Journal(tmp_path / "j.sqlite")
    st = job(*MEMORY, journal=journal)
    batch_step(st, 0)
    gone, *kept = st.ledger.replay.entries
    del st.payloads[payload_key(st.ledger.replay.entries[gone]["ref"])]  # a torn segment
    st = restart(st, journal, now=1)
    st.reconcile(now=1, wall=1)
    assert list(st.ledger.replay.entries) == kept
    assert check(st)["replay"]["lost"] == 1
    journal.close()


def test_leases_count_only_the_fresh_share_of_a_batch_once_the_replay_holds_it():
    """Backpressure (``max_ahead`` batches) counts the fresh rollouts a batch takes:
    PPS - K once the replay can supply K, so fresh rollouts never wait for batches
    further ahead than that (and turn stale)."""
    from test_ledger import AHEAD, R1, lease

    st = job(*MEMORY)
    assert st.ledger.replay.fresh_per_batch() == PPS  # nothing to replay yet
    full = lease(st, R1, AHEAD * PPS + 1)
    assert len(full["lease"]["prompts"]) == AHEAD * PPS
    st = job(*MEMORY)
    batch_step(st, 0)  # trained: the replay holds PPS >= K
    assert st.ledger.replay.fresh_per_batch() == PPS - K
    reply = lease(st, R1, AHEAD * PPS)
    assert len(reply["lease"]["prompts"]) == AHEAD * (PPS - K)

"""The RL ledger, driven through the controller's pure state machine.

Every call goes through :class:`CheckedState`, which after each call (refused
ones too) drains the changes into an in-memory journal, as the server does
before it answers, and checks :func:`check`: the ledger's balance, where each
prompt and rollout is, and that the journal so far rebuilds this very ledger.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from phalanx.config import JobConfig, load_config
from phalanx.controller.core.base import ChangeLog
from phalanx.controller.core.ledger import Ledger, rollout_prompt
from phalanx.controller.core.state import ControllerState, StateError, Tick, UnknownReplica
from phalanx.controller.journal import SqliteJournal as Journal
from phalanx.protocol.rl import Completion, RolloutIn

HEARTBEAT_S = 10.0
QUORUM_S = 60.0
LEASE_S = 5.0
PPS = 4
"""grpo.prompts_per_step"""
G = 2
"""grpo.group_size"""
AHEAD = 2
"""loop.max_ahead: at most AHEAD * PPS prompts leased or waiting."""

P, P2 = "p1:i0", "p2:i0"
R1, R2 = "r1:i0", "r2:i0"


def make_cfg(*overrides: str) -> JobConfig:
    """An RL job: one inner epoch, sync every 2 versions, staleness 2, window 3."""
    return load_config(
        overrides=[
            f"timeouts.heartbeat_s={HEARTBEAT_S}",
            f"timeouts.quorum_s={QUORUM_S}",
            *(
                f"roles.{r}.{k}=1"
                for r in ("policy", "rollout")
                for k in ("min_replicas", "n_init_replicas", "join_timeout_s")
            ),
            f"rl.grpo.prompts_per_step={PPS}",
            f"rl.grpo.group_size={G}",
            "rl.grpo.inner_epochs=1",
            "rl.grpo.max_new_tokens=5",
            "rl.grpo.steps=1000",
            f"rl.loop.max_ahead={AHEAD}",
            f"rl.loop.lease_s={LEASE_S}",
            "rl.loop.sync_every=2",
            "rl.loop.max_staleness=2",
            "rl.loop.window=3",
            "rl.loop.target_exact_match=0.9",
            *overrides,
        ]
    )


# -- the checked state machine ------------------------------------------------------------


def durable(led: Ledger) -> dict[str, Any]:
    """Everything of the ledger that must survive a controller restart, as JSON."""
    p, r, w = led.prompts, led.rollouts, led.weights
    d = {
        "cursor": p.cursor,
        "lease_seq": p.lease_seq,
        "requeue": list(p.requeue),
        "prompts": {i: asdict(q) for i, q in p.by_index.items()},
        "leases": {k: le.record() for k, le in p.leases.items()},
        "seq": r.seq,
        "next_batch": r.next_batch,
        "policy_step": r.policy_step,
        "finished": r.finished,
        "final_step": r.final_step,
        "lineage": r.lineage.batches,
        "discarded": r.discarded,
        "rollouts": r.records,
        "pending": list(r.pending),
        "batches": r.batches,
        "history": r.history,
        "reopened": sorted(r.reopened),
        "want_version": w.want_version,
        "synced_version": w.synced_version,
        "sync_seq": w.sync_seq,
        "mesh_id": w.mesh_id,
        "mesh": w.mesh,
        "counts": led.counts,
        "unswept": led.unswept,
        "replay": led.replay.entries,
        "replay_out": led.replay.out,
        "lineage_replayed": r.lineage.replayed,
        "episodes": led.episodes.kept,
    }
    out: dict[str, Any] = json.loads(json.dumps(d))
    return out


def check(st: ControllerState) -> dict[str, Any]:
    """The ledger's invariants; returns its balance."""
    led = st.ledger
    assert led is not None
    b = led.balance()
    assert b["ok"], b
    p, r = b["prompts"], b["rollouts"]
    assert p["done"] == r["pending"] + r["batched"], "a done prompt without its one rollout"
    assert b["leases"]["open"] == len(led.prompts.leases)
    # Batch indices: every frozen or trained batch is below next_batch, once each.
    assert all(k < led.rollouts.next_batch for k in led.rollouts.batches)
    done = [h["batch"] for h in led.rollouts.history]
    assert done == sorted(set(done)) and all(k < led.rollouts.next_batch for k in done)
    # A batch joins the history when its last step commits, and the lineage when a
    # save holds it: one still frozen in the history is trained, not yet durable.
    assert all(
        "trained_at" in led.rollouts.batches[k] for k in set(done) & set(led.rollouts.batches)
    )
    assert led.rollouts.lineage.rollouts() == led.counts["trained_rollouts"]
    # Replayed uses are counted apart: never a pending or batched fresh rollout.
    replayed = [
        r["rollout_id"] for bt in led.rollouts.batches.values() for r in bt.get("replayed", [])
    ]
    assert not set(replayed) & set(led.rollouts.records)
    assert sum(map(len, led.rollouts.lineage.replayed.values())) == led.counts["replayed_rollouts"]
    assert sum(led.rollouts.discarded.values()) == sum(r["discarded"].values())
    batched = [rid for bt in led.rollouts.batches.values() for rid in bt["rollout_ids"]]
    assert len(batched) == len(set(batched)), "a rollout in two batches"
    assert not set(batched) & set(led.rollouts.pending)
    assert set(led.rollouts.records) == set(batched) | set(led.rollouts.pending)
    for rid, rec in led.rollouts.records.items():
        q = led.prompts.by_index[rec["prompt"]]
        assert (q.state, q.rollout_id) == ("done", rid)
    for i, q in led.prompts.by_index.items():
        assert i < led.prompts.cursor
        if q.state == "queued":
            assert i in led.prompts.requeue, f"prompt {i} is queued but will never be dispatched"
        if q.state == "leased":
            assert q.lease_id in led.prompts.leases and i in led.prompts.leases[q.lease_id].prompts
        else:
            assert q.lease_id is None
    for le in led.prompts.leases.values():
        assert (
            le.lease_id == f"L{int(le.lease_id[1:])}"
            and int(le.lease_id[1:]) <= led.prompts.lease_seq
        )
    # Durability: the changes drained so far rebuild exactly this ledger.
    if isinstance(st, CheckedState):
        assert st.log.changes == []
        assert st.cfg.rl is not None
        twin = Ledger(st.cfg.rl, ChangeLog(100), run="twin")
        twin.restore(st.tables, now=0.0)
        assert durable(twin) == durable(led)
    return b


def _dump(reply: Any) -> dict[str, Any]:
    """A reply of the core as the JSON its HTTP route sends, less the envelope."""
    out: dict[str, Any] = reply.model_dump(mode="json", exclude={"epoch", "job_id"})
    return out


def as_rollout(r: dict[str, Any]) -> RolloutIn:
    """A submitted rollout as the request model carries it, built without checking
    (what these tests submit on purpose may be malformed: the core must refuse it)."""
    comps = [Completion.model_construct(**c) for c in r.get("completions", [])]
    return RolloutIn.model_construct(**{**r, "completions": comps, "ref": r.get("ref")})


class CheckedState(ControllerState):
    """A ControllerState that journals and :func:`check`\\ s after every call, keeps
    its payload log in a dict as the service does (a call's payloads are written
    before its changes, its drops after), and answers the RL requests with the
    JSON their routes send."""

    def __init__(
        self,
        cfg: JobConfig,
        journal: Journal | None = None,
        payloads: dict[str, Any] | None = None,
        *,
        run: str = "run",
        payload_of: Any = None,
    ):
        self.payloads: dict[str, Any] = {} if payloads is None else payloads
        super().__init__(cfg, run=run, payload_of=payload_of or self.payloads.get)
        self.tables: dict[str, dict[str, dict[str, Any]]] = {}
        self.journal = journal
        self.last_changes: list[tuple[str, str, dict[str, Any] | None]] = []

    def commit(self, tick: Tick | None = None) -> None:
        """Write the payloads, drain the changes into the journal (in memory, and the
        real one if any), then drop the payloads let go."""
        if tick is not None:
            self.payloads.update(tick.puts)
        changes = self.last_changes = self.drain()
        for tbl, key, rec in changes:
            if rec is None:
                self.tables.get(tbl, {}).pop(key, None)
            else:
                self.tables.setdefault(tbl, {})[key] = json.loads(json.dumps(rec))
        if self.journal is not None:
            self.journal.write(changes)
        if tick is not None:
            for key in tick.drops:
                self.payloads.pop(key, None)

    def _rl(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, Tick]:
        tick: Tick | None = None
        try:
            reply, tick = getattr(self.rl, name)(*args, **kwargs)
            return reply, tick
        finally:
            self.commit(tick)
            check(self)

    def lease_prompts(self, *args: Any, **kwargs: Any) -> tuple[dict[str, Any], Tick]:
        reply, tick = self._rl("lease_prompts", *args, **kwargs)
        return _dump(reply), tick

    def submit_rollouts(
        self, replica_id: str, lease_id: str, rollouts: list[Any], **kwargs: Any
    ) -> tuple[dict[str, Any], Tick]:
        rolls = [r if isinstance(r, RolloutIn) else as_rollout(r) for r in rollouts]
        reply, tick = self._rl("submit_rollouts", replica_id, lease_id, rolls, **kwargs)
        return _dump(reply), tick

    def lease_batch(self, *args: Any, **kwargs: Any) -> tuple[dict[str, Any], Tick]:
        reply, tick = self._rl("lease_batch", *args, **kwargs)
        return _dump(reply), tick

    def ack_batch(self, *args: Any, **kwargs: Any) -> tuple[dict[str, Any], Tick]:
        reply, tick = self._rl("ack_batch", *args, **kwargs)
        return _dump(reply), tick

    def sync_done(self, *args: Any, **kwargs: Any) -> tuple[dict[str, Any], Tick]:
        reply, tick = self._rl("sync_done", *args, **kwargs)
        return _dump(reply), tick

    def lost_payloads(self, *args: Any, **kwargs: Any) -> tuple[dict[str, Any], Tick]:
        reply, tick = self._rl("lost_payloads", *args, **kwargs)
        return _dump(reply), tick


def _checked(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(self: CheckedState, *args: Any, **kwargs: Any) -> Any:
        tick: Tick | None = None
        try:
            out = fn(self, *args, **kwargs)
            if isinstance(out, Tick):
                tick = out
            elif isinstance(out, tuple) and out and isinstance(out[-1], Tick):
                tick = out[-1]
            return out
        finally:
            self.commit(tick)
            check(self)

    return call


for _name in (
    "start", "register", "deregister", "heartbeat", "tick", "request_quorum", "report_failure",
    "set_desired", "reconcile",
):  # fmt: skip
    setattr(CheckedState, _name, _checked(getattr(ControllerState, _name)))


def sync_for(st: ControllerState, replica_id: str) -> dict[str, Any] | None:
    """The sync order ``replica_id`` must take part in, as its replies carry it."""
    assert st.ledger is not None
    order = st.ledger.weights.order_for(replica_id)
    return None if order is None else order.model_dump(mode="json")


def job(
    *overrides: str,
    policies: tuple[str, ...] = ("p1",),
    rollouts: tuple[str, ...] = ("r1", "r2"),
    journal: Journal | None = None,
) -> CheckedState:
    st = CheckedState(make_cfg(*overrides), journal)
    st.start(0.0, 0.0)
    for n in policies:
        join(st, "policy", n)
    for n in rollouts:
        join(st, "rollout", n)
    return st


def join(
    st: ControllerState, role: str, name: str, *, now: float = 0.0, relays: bool = False
) -> str:
    """Register a replica. ``relays``: a rollout replica whose weight channel can relay
    what it fetched (it advertises ``relays_weights``)."""
    caps = {"relays_weights": True} if relays else {}
    m, _ = st.register(
        role, name, "i0", now=now, wall=now, address=f"{name}-host:29500", capabilities=caps
    )
    return m.replica_id


def run_ahead(st: ControllerState, batches: int = 2) -> None:
    """Let generation run ``batches`` ahead of the policy whatever ``max_staleness``
    allows. The ledger's own staleness rules are tested here apart from the config
    rule (config/rl_loop.py, ``check_ahead``) that keeps a job from asking for this
    on purpose: in a job that keeps that rule, a lagging replica or a requeued
    prompt still makes stale rollouts."""
    st.ledger.loop.max_ahead = batches


def restart(st: CheckedState, journal: Journal, *, now: float) -> CheckedState:
    """A controller restart on the same state dir: rebuild from the real journal."""
    tables = journal.load()
    # The SQLite journal holds what the server would have written.
    assert tables == {t: rows for t, rows in st.tables.items() if rows}
    new = CheckedState.restore(st.cfg, tables, now, payload_of=st.payloads.get)
    assert isinstance(new, CheckedState)
    new.tables, new.journal, new.payloads = tables, journal, st.payloads
    check(new)
    new.start(now, now)
    return new


@pytest.fixture
def st() -> CheckedState:
    return job()


@pytest.fixture
def journal(tmp_path: Path) -> Iterator[Journal]:
    j = Journal(tmp_path / "j.sqlite")
    yield j
    j.close()


# -- requests -----------------------------------------------------------------------------


def rollout(
    rid: str,
    version: int = 0,
    *,
    reward: float = 0.5,
    exact_match: float = 0.0,
    group: int = G,
    tokens: int = 3,
) -> dict[str, Any]:
    comps = [
        {
            "prompt_ids": [1, 2],
            "token_ids": [3] * tokens,
            "logprobs": [-0.5] * tokens,
            "finished": True,
            "reward": reward,
            "versions": [],  # every token at the rollout's version
            "mask": [],  # every token the model's
        }
        for _ in range(group)
    ]
    return {
        "rollout_id": rid,
        "version": version,
        "reward": reward,
        "exact_match": exact_match,
        "completions": comps,
    }


def lease(st: ControllerState, rid: str, n: int = PPS, version: int = 0, *, now: float = 0.0):
    reply, _ = st.lease_prompts(rid, version, n, now=now, wall=now)
    return reply


def declare(st: ControllerState, rid: str, version: int = 0, *, now: float = 0.0):
    """A rollout replica asks for no prompts: it only declares the version it holds,
    which makes it count for the next sync order."""
    reply, _ = st.lease_prompts(rid, version, 0, now=now, wall=now)
    assert reply["lease"] is None
    return reply


def ids(reply: dict[str, Any]) -> list[str]:
    return [p["rollout_id"] for p in reply["lease"]["prompts"]]


def submit(
    st: ControllerState,
    rid: str,
    lease_id: str,
    rollout_ids: list[str],
    version: int = 0,
    *,
    now: float = 0.0,
    **kw: Any,
) -> dict[str, list[str]]:
    rolls = [rollout(x, version, **kw) for x in rollout_ids]
    out, _ = st.submit_rollouts(rid, lease_id, rolls, now=now, wall=now)
    return out


def fill(
    st: ControllerState, n: int = PPS, version: int = 0, *, rid: str = R1, now: float = 0.0, **kw
) -> list[str]:
    """Lease ``n`` prompts and submit them all; returns their rollout ids."""
    reply = lease(st, rid, n, version, now=now)
    out = submit(st, rid, reply["lease"]["lease_id"], ids(reply), version, now=now, **kw)
    assert out["accepted"] == ids(reply)
    return ids(reply)


def train(
    st: ControllerState,
    step: int,
    version: int | None = None,
    *,
    policy: str = P,
    now: float = 0.0,
    **kw: Any,
) -> dict[str, Any]:
    """One batch (inner_epochs=1): fill it from ``version`` (default: ``step``, fresh),
    freeze it for ``step``, commit ``step + 1``."""
    assert st.cfg.rl is not None
    n = st.cfg.rl.grpo.prompts_per_step
    fill(st, n, step if version is None else version, now=now, **kw)
    reply, _ = st.lease_batch(policy, step, now=now, wall=now)
    assert reply["batch"] is not None
    st.ack_batch(policy, step + 1, now=now, wall=now)
    return reply["batch"]


def form(st: ControllerState, rids: list[str], *, now: float = 0.0, step: int = 0) -> None:
    for rid in rids:
        q, _ = st.request_quorum(rid, step, f"{rid}@{now}", 60.0, now=now, wall=now)
    assert q is not None and q.replica_ids == sorted(rids)


def kinds(st: ControllerState) -> list[str]:
    return [e["kind"] for e in st.events]


# -- prompt leases ------------------------------------------------------------------------


def test_lease_hands_out_fresh_prompts_from_the_cursor(st):
    reply = lease(st, R1, 3)
    assert reply["lease"] == {
        "lease_id": "L1",
        "deadline_s": LEASE_S,
        "prompts": [{"index": i, "rollout_id": f"p{i}.0", "resume": None} for i in range(3)],
    }
    assert (reply["sync"], reply["init_weights"], reply["finished"]) == (None, True, False)
    assert (reply["policy_step"], reply["min_version"]) == (0, -2)
    assert ("leases", "L1", st.ledger.prompts.leases["L1"].record()) in st.last_changes
    reply = lease(st, R2, 2)
    assert ids(reply) == ["p3.0", "p4.0"]
    b = check(st)
    assert b["prompts"] == {
        "issued": 5,
        "queued": 0,
        "leased": 5,
        "done": 0,
        "trained": 0,
        "dropped": 0,
    }
    assert b["leases"] == {"open": 2, "issued": 2, "expired": 0}


def test_backpressure_caps_outstanding_prompts(st):
    assert len(ids(lease(st, R1, 6))) == 6
    assert len(ids(lease(st, R2, 4))) == AHEAD * PPS - 6  # only the room left
    assert lease(st, R1)["lease"] is None
    assert check(st)["leases"]["issued"] == 2


def test_prompts_dispatched_again_ignore_backpressure(st):
    lease(st, R1, 4)
    lease(st, R2, 4)
    assert lease(st, R2)["lease"] is None  # 8 outstanding
    st.deregister(R1, now=1, wall=1)
    # Already counted as outstanding: holding them back could only stall the job.
    assert ids(lease(st, R2, 6, now=1)) == ["p0.0", "p1.0", "p2.0", "p3.0"]


def test_refused_lease_keeps_the_journal_in_step(st):
    lease(st, R1, 2)
    lease(st, R2, 6)
    st.tick(now=LEASE_S, wall=LEASE_S)  # both expire: 8 prompts queued
    submit(st, R1, "L1", ["p0.0", "p1.0"], now=LEASE_S)  # late, and accepted
    submit(st, R2, "L2", [f"p{i}.0" for i in range(2, 8)], now=LEASE_S)
    assert len(st.ledger.prompts.requeue) == 8  # entries for prompts no longer queued
    assert lease(st, R1, 2, now=LEASE_S)["lease"] is None  # 8 pending: no room
    # (checked by CheckedState: the journal rebuilds the very same requeue)


def test_pending_rollouts_count_until_a_batch_takes_them(st):
    fill(st, PPS)
    fill(st, PPS)
    assert lease(st, R2)["lease"] is None  # 8 rollouts waiting for the policy
    st.lease_batch(P, 0, now=0, wall=0)  # freezes 4 of them
    assert ids(lease(st, R2)) == [f"p{i}.0" for i in range(8, 12)]


def test_replica_without_weights_gets_no_lease(st):
    reply = lease(st, R1, version=-1)
    assert reply["lease"] is None
    assert reply["init_weights"]  # it may build version 0 from config, then ask again
    assert st.ledger.weights.versions[R1] == -1
    assert check(st)["prompts"]["issued"] == 0
    assert ids(lease(st, R1, version=0)) == [f"p{i}.0" for i in range(PPS)]


def test_init_weights_not_allowed_once_a_newer_version_is_wanted(st):
    train(st, 0)
    assert lease(st, R2, version=-1)["init_weights"]
    train(st, 1)  # commit 2: want_version = 2
    assert st.ledger.weights.want_version == 2
    reply = lease(st, R2, version=-1)
    assert (reply["lease"], reply["init_weights"]) == (None, False)


def test_weights_older_than_the_floor_get_no_lease(st):
    for step in range(3):
        train(st, step)
    # next_batch 3, max_staleness 2: a rollout must come from version >= 1.
    reply = lease(st, R1, version=0)
    assert (reply["lease"], reply["min_version"]) == (None, 1)
    assert st.ledger.weights.versions[R1] == 0
    assert ids(lease(st, R1, version=1)) == [f"p{i}.0" for i in range(12, 16)]


def test_lease_requests_check_role_and_membership(st):
    with pytest.raises(StateError, match="must have role 'rollout'") as e:
        lease(st, P)
    assert e.value.field == "replica_id"
    with pytest.raises(StateError, match="must have role 'policy'"):
        st.lease_batch(R1, 0, now=0, wall=0)
    with pytest.raises(UnknownReplica):
        lease(st, "ghost:1")
    assert check(st)["leases"]["issued"] == 0


def test_job_without_rl_section_refuses_ledger_requests():
    st = ControllerState(
        load_config(overrides=["roles.policy.min_replicas=1", "roles.rollout.min_replicas=1"])
    )
    rid = join(st, "rollout", "r")
    assert st.ledger is None and st.status(0).rl is None
    with pytest.raises(StateError, match="no RL ledger"):
        st.rl.lease_prompts(rid, 0, PPS, now=0, wall=0)
    with pytest.raises(StateError, match="no RL ledger"):
        st.rl.sync_done(rid, 1, 0, True, now=0, wall=0)


# -- rollout submissions ------------------------------------------------------------------


def test_submit_accepts_once_then_drops_duplicates(st):
    form(st, [P])
    reply = lease(st, R1, 2)
    rolls = [rollout(x) for x in ids(reply)]
    out, tick = st.submit_rollouts(R1, "L1", rolls, now=1, wall=1)
    assert out == {
        "accepted": ["p0.0", "p1.0"],
        "duplicate": [],
        "stale": [],
        "unleased": [],
        "discarded": [],
    }
    assert tick.ledger_for == {P}  # policy replicas waiting for a batch
    assert ("leases", "L1", None) in st.last_changes  # fully submitted: closed
    assert st.ledger.rollouts.records["p0.0"]["replica_id"] == R1
    out, tick = st.submit_rollouts(R1, "L1", rolls, now=2, wall=2)  # a retry
    assert out == {
        "accepted": [],
        "duplicate": ["p0.0", "p1.0"],
        "stale": [],
        "unleased": [],
        "discarded": [],
    }
    assert tick == Tick()
    b = check(st)
    assert b["rollouts"]["accepted"] == 2 and b["rollouts"]["pending"] == 2
    assert b["rollouts"]["duplicates_dropped"] == 2
    assert b["prompts"]["done"] == 2


def test_same_rollout_twice_in_one_submission(st):
    lease(st, R1, 1)
    out = submit(st, R1, "L1", ["p0.0", "p0.0"])
    assert out == {
        "accepted": ["p0.0"],
        "duplicate": ["p0.0"],
        "stale": [],
        "unleased": [],
        "discarded": [],
    }


def test_a_rollout_that_could_not_be_scored_is_discarded_and_its_prompt_retired(st):
    form(st, [P])
    lease(st, R1, 2)
    why = "reward math raised ZeroDivisionError: division by zero"
    unscored = {"rollout_id": "p1.0", "version": 0, "reward": 0.0, "exact_match": 0.0}
    out, tick = st.submit_rollouts(
        R1, "L1", [rollout("p0.0"), {**unscored, "discard": why}], now=1, wall=1
    )
    assert (out["accepted"], out["discarded"]) == (["p0.0"], ["p1.0"])
    assert tick.drops == []  # no payload to drop
    ev = [e for e in st.events if e["kind"] == "rollout_discarded"][-1]
    assert (ev["rollout_id"], ev["reason"], ev["detail"]) == ("p1.0", "reward_error", why)
    b = check(st)
    assert b["rollouts"]["discarded"] == {"reward_error": 1} and b["ok"]
    assert b["prompts"]["dropped"] == 1 and b["prompts"]["done"] == 1  # p0 waits to train
    assert "p1.0" not in st.ledger.rollouts.records and 1 not in st.ledger.prompts.by_index
    # The same prompt would fail again: it is not dispatched again; fresh ones are.
    assert ids(lease(st, R2, 1, now=2)) == ["p2.0"]
    # A discard carries no payload; one that does is refused before anything is recorded.
    with pytest.raises(ValidationError, match="neither completions nor a ref"):
        RolloutIn.model_validate({**rollout("p2.0"), "discard": why})


def test_rollouts_of_prompts_never_issued_are_refused_as_unleased(st):
    """Issue 20: a prompt never issued (p7) or an attempt never dispatched (p0.1) was
    accepted and counted as a duplicate. Now it is refused and counted apart."""
    lease(st, R1, 2)
    out = submit(st, R1, "L1", ["p7.0", "p0.1", "p1.0"])
    assert out == {
        "accepted": ["p1.0"],
        "duplicate": [],
        "stale": [],
        "unleased": ["p7.0", "p0.1"],
        "discarded": [],
    }
    assert st.ledger.prompts.leases["L1"].prompts == [0, 1]  # p0 still leased: not closed
    b = check(st)
    assert b["rollouts"]["unleased_refused"] == 2 and b["rollouts"]["duplicates_dropped"] == 0


def test_a_lease_that_never_held_the_prompt_is_refused(st):
    """Issue 20: R2 submitted a prompt leased to R1 (alive) under a made-up lease id, or
    under its own lease of other prompts, and it was accepted. Both are refused now;
    R1's own submission is still accepted after."""
    lease(st, R1, 1)  # L1: p0 for R1
    lease(st, R2, 1)  # L2: p1 for R2
    assert submit(st, R2, "L99", ["p0.0"])["unleased"] == ["p0.0"]  # made up
    assert submit(st, R2, "L2", ["p0.0"])["unleased"] == ["p0.0"]  # not in R2's lease
    assert submit(st, R2, "L1", ["p0.0"])["unleased"] == ["p0.0"]  # R1's lease, not R2's
    assert st.ledger.prompts.by_index[0].state == "leased"  # R1 still holds it
    assert submit(st, R1, "L1", ["p0.0"])["accepted"] == ["p0.0"]
    b = check(st)
    assert b["rollouts"]["unleased_refused"] == 3 and b["rollouts"]["accepted"] == 1
    # Counted in the overview (the dashboard's and the metrics' source) too.
    from phalanx.controller.core.overview import overview

    assert overview(st, now=0.0, wall=0.0).ledger.unleased_refused == 3


def bad_group(r: dict[str, Any]) -> None:
    r["completions"].pop()


def bad_logprobs(r: dict[str, Any]) -> None:
    r["completions"][1]["logprobs"].pop()


def no_tokens(r: dict[str, Any]) -> None:
    r["completions"][0]["token_ids"] = r["completions"][0]["logprobs"] = []


def too_long(r: dict[str, Any]) -> None:
    r["completions"][0]["token_ids"] = [1] * 6
    r["completions"][0]["logprobs"] = [-1.0] * 6


def bad_id(r: dict[str, Any]) -> None:
    r["rollout_id"] = "q1.0"


@pytest.mark.parametrize(
    ("spoil", "field", "match"),
    [
        (bad_group, "rollouts.1.completions", "group_size=2 completions: got 1"),
        (bad_logprobs, "rollouts.1.completions.1", "one log-prob per token"),
        (no_tokens, "rollouts.1.completions.0", "at least one token"),
        (too_long, "rollouts.1.completions.0.token_ids", "max_new_tokens=5"),
        (bad_id, "rollouts.rollout_id", "p<prompt>.<attempt>"),
    ],
)
def test_malformed_submission_is_refused_whole(st, spoil, field, match):
    lease(st, R1, 2)
    before, tables = check(st), json.dumps(st.tables, sort_keys=True)
    rolls = [rollout("p0.0"), rollout("p1.0")]
    spoil(rolls[1])
    with pytest.raises(StateError, match=match) as e:
        st.submit_rollouts(R1, "L1", rolls, now=1, wall=1)
    assert e.value.field == field and e.value.status == 400
    # Nothing recorded, not even the valid first rollout.
    assert st.last_changes == []
    assert check(st) == before
    assert json.dumps(st.tables, sort_keys=True) == tables
    assert [p.state for p in st.ledger.prompts.by_index.values()] == ["leased", "leased"]


@pytest.mark.parametrize("rid", ["p1", "p1.2.3", "1.0", "p-1.0", "p1.-2", "px.0", "p.0", "pp1.0"])
def test_malformed_rollout_ids(rid):
    with pytest.raises(StateError) as e:
        rollout_prompt(rid)
    assert e.value.field == "rollouts.rollout_id"


@pytest.mark.parametrize("rid", ["p 1.0", "p01.0", "p1_0.0", "p+1.0", "p1.0 "])
def test_non_canonical_rollout_ids_are_malformed(rid):
    # One prompt attempt, one id: a second spelling must not be recorded under its own key.
    with pytest.raises(StateError):
        rollout_prompt(rid)


def test_rollout_prompt_parses_canonical_ids():
    assert rollout_prompt("p0.0") == (0, 0)
    assert rollout_prompt("p12.3") == (12, 3)


def test_partial_submission_keeps_the_rest_of_the_lease(st):
    lease(st, R1, 3)
    assert submit(st, R1, "L1", ["p1.0"])["accepted"] == ["p1.0"]
    assert st.ledger.prompts.leases["L1"].prompts == [0, 1, 2]
    assert check(st)["prompts"] == {
        "issued": 3,
        "queued": 0,
        "leased": 2,
        "done": 1,
        "trained": 0,
        "dropped": 0,
    }
    submit(st, R1, "L1", ["p0.0", "p2.0"])
    assert st.ledger.prompts.leases == {}


# -- expiry and eviction ------------------------------------------------------------------


def test_expired_lease_is_dispatched_again_first(st):
    lease(st, R1, 3)
    submit(st, R1, "L1", ["p1.0"])
    assert st.tick(now=LEASE_S - 0.01, wall=0) == Tick()
    tick = st.tick(now=LEASE_S, wall=LEASE_S)
    assert tick.ledger_for == {R1, R2}
    assert st.ledger.prompts.leases == {}
    ev = st.events[-1]
    assert ev["kind"] == "lease_expired"
    assert (ev["lease_id"], ev["replica_id"], ev["prompts"], ev["reason"]) == (
        "L1",
        R1,
        2,
        "deadline passed",
    )
    assert ev["indices"] == [0, 2]
    b = check(st)
    assert b["prompts"]["queued"] == 2 and b["leases"]["expired"] == 1
    # Same attempt (nothing was discarded), ahead of fresh prompts.
    assert ids(lease(st, R2, 4, now=LEASE_S)) == ["p0.0", "p2.0", "p3.0", "p4.0"]


def test_evicted_holders_prompts_go_back_at_once():
    st = job("rl.loop.lease_s=30")  # only the holder's eviction returns anything
    lease(st, R1, 2)
    lease(st, R2, 2)
    st.heartbeat(P, now=HEARTBEAT_S - 1)
    st.heartbeat(R2, now=HEARTBEAT_S - 1)
    tick = st.tick(now=HEARTBEAT_S, wall=HEARTBEAT_S)
    assert tick.evicted == [R1]
    assert tick.ledger_for == {R2}
    assert st.events[-1]["reason"] == f"holder {R1} gone"
    assert R1 not in st.ledger.weights.versions
    assert list(st.ledger.prompts.requeue) == [0, 1]
    assert ids(lease(st, R2, 2, now=HEARTBEAT_S)) == ["p0.0", "p1.0"]


def test_deregistered_holders_prompts_go_back_at_once(st):
    lease(st, R1, 2)
    tick = st.deregister(R1, "done", now=1, wall=1)
    assert tick.ledger_for == {R2}
    assert check(st)["prompts"]["queued"] == 2
    # A holder with nothing outstanding wakes nobody.
    lease(st, R2, 1)
    submit(st, R2, "L2", ["p0.0"])
    assert st.deregister(R2, now=1, wall=1).ledger_for == set()


def test_late_submission_wins_and_the_new_holders_copy_is_a_duplicate(st):
    lease(st, R1, 2)
    st.tick(now=LEASE_S, wall=LEASE_S)
    assert ids(lease(st, R2, 2, now=LEASE_S)) == ["p0.0", "p1.0"]
    out = submit(st, R1, "L1", ["p0.0"], now=LEASE_S + 1)  # L1 is long gone
    assert out["accepted"] == ["p0.0"]
    assert st.ledger.prompts.leases["L2"].prompts == [1]  # taken off the new holder's lease
    assert ("leases", "L2", st.ledger.prompts.leases["L2"].record()) in st.last_changes
    out = submit(st, R2, "L2", ["p0.0", "p1.0"], now=LEASE_S + 1)
    assert out == {
        "accepted": ["p1.0"],
        "duplicate": ["p0.0"],
        "stale": [],
        "unleased": [],
        "discarded": [],
    }
    assert st.ledger.prompts.leases == {}
    b = check(st)
    assert b["rollouts"]["accepted"] == 2 and b["rollouts"]["duplicates_dropped"] == 1
    assert st.ledger.rollouts.records["p0.0"]["replica_id"] == R1


def test_late_submission_of_an_undispatched_prompt_is_accepted(st):
    lease(st, R1, 2)
    st.tick(now=LEASE_S, wall=LEASE_S)
    assert submit(st, R1, "L1", ["p0.0", "p1.0"], now=LEASE_S)["accepted"] == ["p0.0", "p1.0"]
    assert ids(lease(st, R2, 2, now=LEASE_S)) == ["p2.0", "p3.0"]  # requeue skipped


def test_lease_taken_over_in_full_expires_quietly(st):
    lease(st, R1, 1)
    st.tick(now=LEASE_S, wall=LEASE_S)
    lease(st, R2, 1, now=LEASE_S)
    submit(st, R1, "L1", ["p0.0"], now=LEASE_S)
    assert "L2" not in st.ledger.prompts.leases  # nothing left in it: R2 is no longer busy
    st.tick(now=2 * LEASE_S, wall=2 * LEASE_S)
    b = check(st)
    assert b["leases"] == {"open": 0, "issued": 2, "expired": 1}  # L2 returned nothing


# -- batches ------------------------------------------------------------------------------


def test_every_policy_replica_gets_the_same_frozen_batch():
    st = job(policies=("p1", "p2"))
    fill(st, 2, exact_match=1.0, reward=1.0)
    fill(st, 3, exact_match=0.0, reward=0.0)
    a, _ = st.lease_batch(P, 0, now=1, wall=1)
    assert st.last_changes and ("batches", "0", st.ledger.rollouts.batches[0]) in st.last_changes
    b, _ = st.lease_batch(P2, 0, now=1, wall=1)
    assert a == b
    assert st.last_changes == []  # the second ask changes nothing
    batch = a["batch"]
    assert [r["rollout_id"] for r in batch["rollouts"]] == ["p0.0", "p1.0", "p2.0", "p3.0"]
    assert (batch["index"], batch["step"], batch["frozen_at"]) == (0, 0, 1)
    assert (batch["reward"], batch["exact_match"], batch["staleness"]) == (0.5, 0.5, 0)
    assert "rollout_ids" not in batch
    assert batch["rollouts"][0]["completions"] == rollout("p0.0", reward=1.0)["completions"]
    assert (a["sync"], a["finished"]) == (None, False)
    bal = check(st)
    assert (bal["rollouts"]["pending"], bal["rollouts"]["batched"]) == (1, 4)
    assert st.ledger.rollouts.next_batch == 1


def test_no_batch_until_enough_rollouts(st):
    fill(st, PPS - 1)
    reply, _ = st.lease_batch(P, 0, now=0, wall=0)
    assert reply["batch"] is None
    assert st.ledger.rollouts.next_batch == 0 and check(st)["rollouts"]["pending"] == PPS - 1


def test_inner_epochs_share_one_batch():
    st = job("rl.grpo.inner_epochs=2", "rl.loop.max_staleness=4")
    fill(st, PPS)
    first, _ = st.lease_batch(P, 0, now=0, wall=0)
    again, _ = st.lease_batch(P, 1, now=0, wall=0)
    assert first["batch"]["index"] == again["batch"]["index"] == 0
    assert first == again
    st.ack_batch(P, 1, now=0, wall=0)  # half way through the batch: nothing trained
    assert check(st)["rollouts"]["batched"] == PPS and st.ledger.rollouts.history == []
    fill(st, PPS)
    nxt, _ = st.lease_batch(P, 2, now=0, wall=0)
    assert nxt["batch"]["index"] == 1
    assert nxt["batch"]["rollouts"][0]["rollout_id"] == f"p{PPS}.0"
    st.ack_batch(P, 2, now=0, wall=0)
    assert [h["batch"] for h in st.ledger.rollouts.history] == [0]
    assert st.ledger.policy_step == 2


def test_ack_trains_the_batch_and_drops_its_payloads(st):
    fill(st, PPS, exact_match=0.5, reward=2.0)
    st.lease_batch(P, 0, now=0, wall=0)
    reply, tick = st.ack_batch(P, 1, now=3, wall=3)
    assert (reply["sync"], reply["finished"]) == (None, False)
    assert tick.ledger_for == {R1, R2}  # room for more prompts
    for tbl in ("rollouts", "batches", "prompts"):
        assert st.tables.get(tbl, {}) == {}
    assert st.ledger.rollouts.records == {} and st.ledger.prompts.by_index == {}
    b = check(st)
    assert b["prompts"]["trained"] == PPS
    assert (b["rollouts"]["trained"], b["rollouts"]["batched"]) == (PPS, 0)
    assert st.ledger.counts["trained_completions"] == PPS * G
    assert st.ledger.rollouts.history == [
        {
            "batch": 0,
            "step": 1,
            "reward": 2.0,
            "exact_match": 0.5,
            "reward_avg": 2.0,
            "exact_match_avg": 0.5,
            "staleness": 0,
            "at": 3,
        }
    ]
    assert st.tables["rl_history"] == {"0": st.ledger.rollouts.history[0]}
    # Idempotent: a repeated ack moves nothing and wakes nobody.
    _, tick = st.ack_batch(P, 1, now=4, wall=4)
    assert tick == Tick() and st.last_changes == []
    assert len(st.ledger.rollouts.history) == 1


def test_an_acks_metrics_go_into_the_history_with_the_jobs_token_rate(st):
    fill(st, PPS)
    st.lease_batch(P, 0, now=0, wall=0)
    st.ack_batch(P, 1, now=3, wall=3, metrics={"tokens": 40, "entropy": 1.5})
    first = st.ledger.rollouts.history[0]
    assert first["metrics"] == {"tokens": 40, "entropy": 1.5}
    assert "tokens_per_s" not in first  # no batch before it to time it from
    fill(st, PPS)
    st.lease_batch(P, 1, now=4, wall=4)
    metrics = {"tokens": 50, "train_tokens_per_s": 99.0, "idle": 0.25}
    st.ack_batch(P, 2, now=7, wall=8, metrics=metrics)
    second = st.ledger.rollouts.history[1]
    assert second["tokens_per_s"] == 10.0  # 50 tokens over the 5 s since batch 0
    assert st.tables["rl_history"]["1"] == second  # journaled: a restart keeps it
    status = st.status(now=8, wall=8).rl
    assert status is not None and status.last is not None
    assert status.last.metrics is not None and status.last.metrics.train_tokens_per_s == 99.0
    # The policy's idle fraction reaches the overview (the dashboard, /metrics).
    job_rl = st.status(now=8, wall=8).overview.job.rl
    assert job_rl is not None and job_rl.policy_idle == 0.25
    # A repeated ack does not overwrite what the first one recorded.
    st.ack_batch(P, 2, now=9, wall=9, metrics={"tokens": 1})
    assert st.ledger.rollouts.history[1] == second


def test_off_policy_metrics_survive_a_restart_and_reach_the_overview(journal):
    st = job(journal=journal)
    fill(st, PPS)
    st.lease_batch(P, 0, now=0, wall=0)
    off = {
        "ess": 0.75,
        "mismatch_kl": 0.02,
        "is_mask_frac": 0.1,
        "staleness_tokens": {"0": 30, "2": 5},
    }
    st.ack_batch(P, 1, now=3, wall=3, metrics={"tokens": 35, **off})
    new = restart(st, journal, now=4)
    status = new.status(now=4, wall=4)
    assert status.rl is not None and status.rl.last is not None
    m = status.rl.last.metrics
    assert m is not None and m.staleness_tokens == {"0": 30, "2": 5} and m.ess == 0.75
    rl = status.overview.job.rl
    assert rl is not None and rl.staleness_tokens == {"0": 30, "2": 5}
    assert (rl.ess, rl.mismatch_kl, rl.is_mask_frac, rl.is_clip_frac) == (0.75, 0.02, 0.1, None)


def test_a_batch_ask_acknowledges_only_the_steps_a_checkpoint_holds(st):
    fill(st, PPS)
    st.lease_batch(P, 0, now=0, wall=0)
    fill(st, PPS)
    # Step 1 is committed in memory, but its checkpoint has not committed yet: the
    # batch stays frozen, so a crash now can retrain it from the checkpoint of step 0.
    reply, _ = st.lease_batch(P, 1, now=1, wall=1, durable=0)
    assert reply["batch"]["index"] == 1
    assert st.ledger.policy_step == 0 and 0 in st.ledger.rollouts.batches
    # Trained (committed: in the history, which decides the job's end), not durable.
    assert [h["batch"] for h in st.ledger.rollouts.history] == [0]
    # A replica restarted from that checkpoint asks for step 0's batch: the same rollouts.
    again, _ = st.lease_batch(P, 0, now=2, wall=2, durable=0)
    assert again["batch"]["index"] == 0 and "rollback" not in kinds(st)
    # Once the save commits, the next ask acknowledges it.
    st.lease_batch(P, 1, now=3, wall=3, durable=1)
    assert st.ledger.policy_step == 1 and [h["batch"] for h in st.ledger.rollouts.history] == [0]
    assert check(st)["prompts"]["trained"] == PPS


def test_an_ack_syncs_at_once_and_drops_its_batch_once_a_checkpoint_holds_it():
    st = job("rl.loop.sync_every=1")
    declare(st, R2)
    form(st, [P])
    fill(st, PPS, reward=2.0)
    st.lease_batch(P, 0, now=0, wall=0)
    # Step 1 is committed, its checkpoint not yet: weights may sync from it now, and
    # the batch stays frozen with the figures the policy measured on it.
    reply, tick = st.ack_batch(P, 1, now=3, wall=3, metrics={"tokens": 40}, durable=0)
    assert st.ledger.weights.want_version == 1 and reply["sync"] is not None
    assert tick.ledger_for >= {P}  # the leader is woken to serve the sync
    batch = st.ledger.rollouts.batches[0]
    assert (batch["trained_at"], batch["metrics"]) == (3, {"tokens": 40})
    assert st.tables["batches"]["0"] == batch  # journaled: a restart keeps them
    assert st.ledger.policy_step == 0
    (h,) = st.ledger.rollouts.history  # in the history at its commit
    assert (h["at"], h["metrics"]) == (3, {"tokens": 40})
    # The save commits: the durable ack drops the batch; its history entry stays as is.
    st.ack_batch(P, 1, now=5, wall=5, durable=1)
    assert 0 not in st.ledger.rollouts.batches and st.ledger.policy_step == 1
    assert st.ledger.rollouts.history == [h]
    assert st.ledger.rollouts.lineage.batches == {0: batch["rollout_ids"]}
    assert check(st)["prompts"]["trained"] == PPS


def test_a_policy_back_from_an_older_checkpoint_rewinds_the_weight_versions():
    st = job("rl.loop.sync_every=1")
    fill(st, PPS)
    st.lease_batch(P, 0, now=0, wall=0)
    st.ack_batch(P, 1, now=1, wall=1, durable=0)
    assert st.ledger.weights.want_version == 1
    # Every policy replica died before the save of step 1 committed: the one restarted
    # from step 0 gets the same frozen batch, and version 1 is wanted again from it.
    again, _ = st.lease_batch(P, 0, now=2, wall=2, durable=0)
    assert again["batch"]["index"] == 0
    assert "policy_behind" in kinds(st) and "policy_rewind" not in kinds(st)
    assert (st.ledger.weights.want_version, st.ledger.weights.synced_version) == (0, 0)
    st.ack_batch(P, 1, now=3, wall=3, durable=1)
    assert st.ledger.weights.want_version == 1 and st.ledger.policy_step == 1


def test_no_batch_is_frozen_past_the_jobs_last_while_its_ack_waits():
    st = job("rl.grpo.steps=1")
    fill(st, PPS)
    assert st.lease_batch(P, 0, now=0, wall=0)[0]["batch"]["index"] == 0
    fill(st, PPS)
    # Step 1 is committed but its checkpoint is not yet: the job is not finished, and
    # batch 1 would be past grpo.steps.
    reply, _ = st.lease_batch(P, 1, now=1, wall=1, durable=0)
    assert reply["batch"] is None and not reply["finished"]
    assert 1 not in st.ledger.rollouts.batches
    reply, _ = st.ack_batch(P, 1, now=2, wall=2)
    assert reply["finished"]


def test_batch_lease_covers_a_lost_ack(st):
    fill(st, PPS)
    st.lease_batch(P, 0, now=0, wall=0)
    fill(st, PPS, exact_match=1.0)
    # The replica committed step 1 but its ack was lost: asking for step 1 says so.
    reply, _ = st.lease_batch(P, 1, now=1, wall=1)
    assert reply["batch"]["index"] == 1
    assert [h["batch"] for h in st.ledger.rollouts.history] == [0]
    assert st.ledger.policy_step == 1 and 0 not in st.ledger.rollouts.batches
    assert check(st)["prompts"]["trained"] == PPS
    # The ack arriving late after all changes nothing.
    _, tick = st.ack_batch(P, 1, now=2, wall=2)
    assert tick == Tick() and len(st.ledger.rollouts.history) == 1


def test_ack_without_a_frozen_batch_moves_the_step(st):
    _, tick = st.ack_batch(P, 1, now=0, wall=0)
    assert st.ledger.policy_step == 1 and tick.ledger_for == {R1, R2}
    assert check(st)["prompts"]["trained"] == 0


def test_stale_rollouts_are_discarded_at_freeze_and_dispatched_again():
    st = job(
        "rl.grpo.prompts_per_step=2",
        "rl.loop.max_staleness=0",
        "rl.loop.sync_every=1",
        "rl.loop.max_ahead=1",
    )
    run_ahead(st)
    reply = lease(st, R1, 4)
    submit(st, R1, "L1", ids(reply), version=0)
    first, _ = st.lease_batch(P, 0, now=0, wall=0)
    assert [r["rollout_id"] for r in first["batch"]["rollouts"]] == ["p0.0", "p1.0"]
    st.ack_batch(P, 1, now=0, wall=0)
    # Batch 1 trains from version 1: the two version-0 rollouts left are too old.
    reply, tick = st.lease_batch(P, 1, now=1, wall=1)
    assert reply["batch"] is None
    assert tick.ledger_for >= {R1, R2}
    b = check(st)
    assert b["rollouts"]["discarded"] == {"stale": 2} and b["rollouts"]["pending"] == 0
    assert b["prompts"]["queued"] == 2
    assert [
        (e["rollout_id"], e["reason"]) for e in st.events if e["kind"] == "rollout_discarded"
    ] == [
        ("p2.0", "stale"),
        ("p3.0", "stale"),
    ]
    assert ("rollouts", "p2.0", None) in st.last_changes
    assert lease(st, R2, 2, version=0)["lease"] is None  # too old to lease, too
    again = lease(st, R2, 2, version=1)
    assert ids(again) == ["p2.1", "p3.1"]  # a new attempt, a new id
    assert submit(st, R1, "L1", ["p2.0"], version=0)["duplicate"] == ["p2.0"]
    assert submit(st, R2, again["lease"]["lease_id"], ["p2.1", "p3.1"], 1)["accepted"] == [
        "p2.1",
        "p3.1",
    ]
    reply, _ = st.lease_batch(P, 1, now=1, wall=1)
    assert [r["rollout_id"] for r in reply["batch"]["rollouts"]] == ["p2.1", "p3.1"]


def test_stale_submission_is_discarded_at_once():
    st = job(
        "rl.grpo.prompts_per_step=2",
        "rl.loop.max_staleness=0",
        "rl.loop.sync_every=1",
        "rl.loop.max_ahead=1",
    )
    run_ahead(st)
    lease(st, R1, 4)
    submit(st, R1, "L1", ["p0.0", "p1.0"])
    st.lease_batch(P, 0, now=0, wall=0)  # next batch is 1: floor 1
    out, tick = st.submit_rollouts(
        R1, "L1", [rollout("p2.0", 0), rollout("p3.0", 1)], now=0, wall=0
    )
    assert out == {
        "accepted": ["p3.0"],
        "duplicate": [],
        "stale": ["p2.0"],
        "unleased": [],
        "discarded": [],
    }
    assert tick.ledger_for == {P, R1, R2}
    assert st.ledger.prompts.by_index[2].rollout_id == "p2.1"
    assert check(st)["rollouts"]["discarded"] == {"stale": 1}


def test_a_policy_asking_below_the_ledger_rolls_back_explicitly(st):
    """Quorum formation makes this impossible (a round behind the role's step waits,
    then rolls back, and the ledger follows first: test_state_lineage.py); were a
    replica to ask below the ledger all the same, it is a rollback on the record,
    never a silent rewind that keeps counting the lost batches as trained."""
    first = train(st, 0, exact_match=0.2)["rollouts"]
    second = train(st, 1, exact_match=0.4)["rollouts"]
    trained = [r["rollout_id"] for r in first + second]
    fill(st, PPS)
    # Every replica that trained is gone; a fresh one starts over at step 0.
    reply, _ = st.lease_batch(P, 0, now=9, wall=9)
    (ev,) = [e for e in st.events if e["kind"] == "rollback"]
    assert (ev["from_step"], ev["to_step"], ev["batches"], ev["prompts"]) == (2, 0, 2, 2 * PPS)
    # Their prompts are issued again (a new attempt each); their rollouts discarded.
    assert sorted(st.ledger.prompts.requeue) == sorted(int(r[1:].split(".")[0]) for r in trained)
    assert all(st.ledger.prompts.by_index[i].attempt == 1 for i in st.ledger.prompts.requeue)
    assert st.ledger.rollouts.discarded == {"rolled_back": 2 * PPS}
    assert reply["batch"]["index"] == 0
    assert [r["rollout_id"] for r in reply["batch"]["rollouts"]] == [
        "p8.0",
        "p9.0",
        "p10.0",
        "p11.0",
    ]
    assert st.ledger.policy_step == 0 and st.ledger.weights.want_version == 0
    st.ack_batch(P, 1, now=9, wall=9)
    assert [h["batch"] for h in st.ledger.rollouts.history] == [0]
    assert st.ledger.rollouts.history[0]["at"] == 9
    assert check(st)["prompts"]["trained"] == PPS


def test_a_rewind_unfreezes_the_batches_frozen_ahead():
    st = job("rl.grpo.prompts_per_step=2")
    train(st, 0)
    train(st, 1)
    old = fill(st, 2, 2)
    st.lease_batch(P, 2, now=0, wall=0)  # frozen, then the policy is lost before training it
    new = fill(st, 2, 2)
    reply, _ = st.lease_batch(P, 1, now=1, wall=1)  # a fresh policy, restored from step 1
    assert "rollback" in kinds(st)
    assert [r["rollout_id"] for r in reply["batch"]["rollouts"]] == old  # oldest first
    assert list(st.ledger.rollouts.batches) == [1] and list(st.ledger.rollouts.pending) == new
    assert st.ledger.rollouts.next_batch == 2
    st.ack_batch(P, 2, now=1, wall=1)
    reply, _ = st.lease_batch(P, 2, now=1, wall=1)
    assert [r["rollout_id"] for r in reply["batch"]["rollouts"]] == new  # a fresh batch 2
    st.ack_batch(P, 3, now=1, wall=1)
    # Asking for a trained batch again rewinds: it never freezes a second batch 2.
    fill(st, 2, 3)
    st.lease_batch(P, 2, now=2, wall=2)
    assert [h["batch"] for h in st.ledger.rollouts.history] == [0, 1]
    assert list(st.ledger.rollouts.batches) == [2] and st.ledger.rollouts.next_batch == 3


# -- finishing ----------------------------------------------------------------------------


def test_finished_once_the_window_reaches_the_target(st):
    for step, em in enumerate([1.0, 1.0, 0.5, 1.0, 1.0]):
        train(st, step, exact_match=em)
        assert not st.ledger.finished, step  # a full window of 3 averaging < 0.9
    fill(st, PPS, 5, exact_match=1.0)
    st.lease_batch(P, 5, now=0, wall=0)
    _, tick = st.ack_batch(P, 6, now=0, wall=0)
    assert st.ledger.finished
    assert tick.ledger_for >= {P, R1, R2}  # every long-poll learns of it
    assert st.ledger.rollouts.history[-1]["exact_match_avg"] == 1.0
    ev = st.events[-1] if st.events[-1]["kind"] == "rl_finished" else None
    assert ev is not None and (ev["batch"], ev["step"]) == (5, 6)
    reply = lease(st, R1)
    assert (reply["lease"], reply["finished"]) == (None, True)
    reply, _ = st.lease_batch(P, 6, now=0, wall=0)
    assert (reply["batch"], reply["finished"]) == (None, True)


def test_short_history_does_not_finish_early(st):
    train(st, 0, exact_match=1.0)
    train(st, 1, exact_match=1.0)
    assert not st.ledger.finished  # 2 of the 3 batches of the window
    train(st, 2, exact_match=1.0)
    assert st.ledger.finished


def test_window_of_one_looks_at_the_last_batch_only():
    st = job("rl.loop.window=1")
    train(st, 0, exact_match=0.5)
    assert not st.ledger.finished
    train(st, 1, exact_match=1.0)
    assert st.ledger.rollouts.history[-1]["exact_match_avg"] == 1.0
    assert st.ledger.finished


def test_finished_once_the_reward_reaches_its_target():
    st = job("rl.loop.target_exact_match=null", "rl.loop.target_reward=0.75", "rl.loop.window=2")
    train(st, 0, reward=1.0)
    assert not st.ledger.finished  # half a window
    train(st, 1, reward=0.5)
    assert st.ledger.rollouts.history[-1]["reward_avg"] == 0.75
    assert st.ledger.finished


def test_finished_after_grpo_steps_without_a_target():
    st = job("rl.grpo.steps=2", "rl.loop.target_exact_match=null")
    train(st, 0, exact_match=1.0)
    train(st, 1, exact_match=0.0)
    assert st.ledger.finished
    assert lease(st, R1)["lease"] is None


def test_no_rewind_after_the_finish():
    st = job("rl.grpo.steps=1")
    train(st, 0)
    assert st.ledger.finished
    reply, _ = st.lease_batch(P, 0, now=1, wall=1)  # a fresh policy replica, too late
    assert (reply["batch"], reply["finished"]) == (None, True)
    assert (st.ledger.policy_step, st.ledger.rollouts.next_batch) == (1, 1)
    assert "policy_rewind" not in kinds(st)


# -- weight sync --------------------------------------------------------------------------


@pytest.fixture
def synced() -> CheckedState:
    """Two policy replicas in a quorum (leader P), two rollouts that declared version 0,
    and a commit at version 2 that ordered the first sync."""
    st = job(policies=("p1", "p2"))
    declare(st, R2)
    form(st, [P, P2])
    train(st, 0)
    assert st.ledger.weights.sync is None  # commit 1: no sync due
    fill(st, PPS)
    st.lease_batch(P, 1, now=0, wall=0)
    reply, tick = st.ack_batch(P, 2, now=0, wall=0)
    assert reply["sync"] == {
        "seq": 1,
        "mesh_id": 1,
        "members": [P, R1, R2],
        "rank": 0,
        "store": "p1-host:29500",
        "ordered_at": 0.0,
        "published_at": 0.0,
    }
    assert tick.ledger_for == {P, R1, R2}
    return st


def test_sync_is_ordered_after_sync_every_commits(synced):
    st = synced
    assert st.ledger.weights.want_version == 2
    reply = lease(st, R2)
    assert reply["sync"] == {
        "seq": 1,
        "mesh_id": 1,
        "members": [P, R1, R2],
        "rank": 2,
        "store": "p1-host:29500",
        "ordered_at": 0.0,
        "published_at": 0.0,
    }
    assert reply["lease"] is not None  # version 0 is still fresh enough to generate
    b, _ = st.lease_batch(P2, 2, now=0, wall=0)
    assert b["sync"] is None  # not the leader: not in the mesh
    assert "sync_ordered" in kinds(st)


def test_sync_completes_when_every_member_reports(synced):
    st = synced
    assert st.sync_done(P, 1, 2, True, now=1, wall=1)[0] == {"synced_version": 0}
    _, tick = st.sync_done(R1, 1, 2, True, now=1, wall=1)
    assert tick == Tick()
    assert lease(st, R1, version=2)["sync"] is None  # done its part
    assert lease(st, R2, version=0)["sync"]["rank"] == 2
    reply, tick = st.sync_done(R2, 1, 2, True, now=1, wall=1)
    assert reply == {"synced_version": 2}
    assert tick.ledger_for == {R1, R2}
    w = st.status(1).model_dump(mode="json")["rl"]["weights"]
    assert (w["want_version"], w["synced_version"], w["sync_in_flight"]) == (2, 2, None)
    assert w["versions"][R1] == w["versions"][R2] == 2
    assert st.events[-1]["kind"] == "sync_done"
    # Reports for a finished sync are ignored.
    events = len(st.events)
    st.sync_done(R2, 1, 2, False, "late", now=2, wall=2)
    assert st.ledger.weights.sync is None and (
        st.ledger.weights.synced_version,
        st.ledger.weights.versions[R2],
    ) == (2, 2)
    assert len(st.events) == events


def test_failed_sync_is_ordered_again_on_a_new_mesh(synced):
    st = synced
    st.sync_done(P, 1, 2, True, now=1, wall=1)
    _, tick = st.sync_done(R1, 1, -1, False, "nccl timeout", now=1, wall=1)
    assert "sync_failed" in kinds(st)
    assert tick.ledger_for == {R1, R2}  # no order yet: no member has asked again
    assert st.ledger.weights.sync is None and st.ledger.weights.mesh == []
    declare(st, R1, now=1)
    declare(st, R2, now=1)
    order = sync_for(st, R1)
    assert (order["seq"], order["mesh_id"], order["members"]) == (2, 2, [P, R1])
    # The old sync's reports no longer count.
    assert st.sync_done(R2, 1, 2, True, now=1, wall=1)[1] == Tick()
    assert st.ledger.weights.sync is not None and st.ledger.weights.sync.done == {}


def test_evicted_member_fails_the_sync(synced):
    st = synced
    st.deregister(R2, "gone", now=1, wall=1)
    assert st.ledger.weights.sync is None
    assert "sync_failed" in kinds(st)
    assert declare(st, R1, now=1)["sync"] is None  # the leader has not reported yet
    _, tick = st.sync_done(P, 1, -1, False, "peer gone", now=1, wall=1)
    assert tick.ledger_for == {P, R1}
    order = sync_for(st, R1)
    assert (order["seq"], order["mesh_id"], order["members"]) == (2, 2, [P, R1])


def test_failed_sync_never_rebuilds_on_the_broken_mesh_after_a_restart(journal):
    st = job(policies=("p1", "p2"), journal=journal)
    declare(st, R2)
    form(st, [P, P2])
    train(st, 0)
    train(st, 1)
    assert st.ledger.weights.sync is not None and st.ledger.weights.mesh == [P, R1, R2]
    st.sync_done(R1, 1, 2, True, now=1, wall=1)
    st.sync_done(R2, 1, 2, True, now=1, wall=1)
    st.sync_done(P, 1, -1, False, "broadcast failed", now=1, wall=1)  # the leader's side
    assert st.ledger.weights.sync is None  # the rollouts hold version 2: nothing to order now
    assert st.ledger.weights.mesh == []
    new = restart(st, journal, now=2)
    assert new.ledger.weights.mesh == []
    # Versions are not durable: each rollout declares its own with its next ask.
    assert lease(new, R1, version=2, now=2)["sync"] is None
    assert declare(new, R2, 2, now=2)["sync"] is None
    r3 = join(new, "rollout", "r3", now=2)
    order = lease(new, r3, version=-1, now=2)["sync"]
    assert (order["seq"], order["mesh_id"], order["members"]) == (2, 2, [P, r3])


def test_sync_timeout_orders_it_again(synced):
    st = synced
    limit = st.ledger.weights.timeout_s
    for now in (limit, limit + 0.01):
        for rid in (P, P2, R1, R2):
            st.heartbeat(rid, now=now)
        tick = st.tick(now=now, wall=now)
        if now == limit:
            assert tick == Tick()  # not yet
    assert [e["reason"] for e in st.events if e["kind"] == "sync_failed"] == ["timed out"]
    assert st.ledger.weights.sync is None  # the silent members must ask again, the leader report
    for rid in (R1, R2):
        declare(st, rid, now=now)
    assert st.ledger.weights.sync is None
    _, tick = st.sync_done(P, 1, -1, False, "broadcast timed out", now=now, wall=now)
    assert tick.ledger_for == {P, R1, R2}
    order = st.ledger.weights.sync
    assert (order.seq, order.mesh_id, order.members) == (2, 2, [P, R1, R2])


def test_same_mesh_keeps_its_id(synced):
    st = synced
    for rid in (P, R1, R2):
        st.sync_done(rid, 1, 2, True, now=1, wall=1)
    for step in (2, 3):
        train(st, step, version=2)
    order = st.ledger.weights.sync
    assert order is not None and (order.seq, order.mesh_id) == (2, 1)


def test_no_sync_without_a_policy_leader():
    st = job()
    declare(st, R2)
    train(st, 0)
    train(st, 1)
    assert (
        st.ledger.weights.want_version == 2 and st.ledger.weights.sync is None
    )  # no policy quorum
    form(st, [P])
    st.tick(now=0, wall=0)
    assert st.ledger.weights.sync is not None and st.ledger.weights.sync.members == [P, R1, R2]


def test_no_sync_when_rollouts_already_hold_the_version(synced):
    st = synced
    for rid in (P, R1, R2):
        st.sync_done(rid, 1, 2, True, now=1, wall=1)
    assert st.tick(now=1, wall=1) == Tick() and st.ledger.weights.sync is None


def test_joiner_syncs_before_it_may_lease(synced):
    st = synced
    for rid in (P, R1, R2):
        st.sync_done(rid, 1, 2, True, now=1, wall=1)
    r3 = join(st, "rollout", "r3", now=1)
    reply = lease(st, r3, version=-1, now=1)
    assert (reply["lease"], reply["init_weights"]) == (None, False)
    assert reply["sync"] == {
        "seq": 2,
        "mesh_id": 2,  # the replicas already at version 2 stay out of it
        "members": [P, r3],
        "rank": 1,
        "store": "p1-host:29500",
        "ordered_at": 1.0,
        "published_at": 1.0,
    }
    st.sync_done(P, 2, 2, True, now=2, wall=2)
    again = lease(st, r3, version=-1, now=2)  # not before it has the weights
    assert again["lease"] is None and again["sync"] == reply["sync"]
    st.sync_done(r3, 2, 2, True, now=2, wall=2)
    assert st.ledger.weights.sync is None and st.ledger.weights.synced_version == 2
    assert lease(st, r3, version=2, now=2)["lease"] is not None


def test_replicas_busy_generating_join_the_next_sync():
    st = job()
    form(st, [P])
    train(st, 0)
    fill(st, PPS, 1)
    lease(st, R2, 2, version=1)  # R2 is generating when the sync is due
    st.lease_batch(P, 1, now=0, wall=0)
    st.ack_batch(P, 2, now=0, wall=0)
    assert st.ledger.weights.sync is not None and st.ledger.weights.sync.members == [P, R1]
    assert sync_for(st, R2) is None
    submit(st, R2, "L3", ["p8.0", "p9.0"], 1)
    st.sync_done(P, 1, 2, True, now=1, wall=1)
    _, tick = st.sync_done(R1, 1, 2, True, now=1, wall=1)
    assert st.ledger.weights.synced_version == 2
    order = st.ledger.weights.sync  # R2, idle now, gets its own
    assert order is not None and (order.seq, order.mesh_id, order.members) == (2, 2, [P, R2])
    assert tick.ledger_for == {P, R1, R2}


def test_no_sync_once_finished():
    st = job("rl.grpo.steps=2")
    form(st, [P])
    train(st, 0)
    train(st, 1)
    assert st.ledger.finished and st.ledger.weights.want_version == 2
    assert st.ledger.weights.sync is None
    r3 = join(st, "rollout", "r3")
    reply = lease(st, r3, version=-1)
    assert (reply["lease"], reply["sync"], reply["finished"]) == (None, None, True)


def test_sync_done_from_outside_the_mesh_is_ignored(synced):
    st = synced
    assert st.sync_done(P2, 1, 2, True, now=1, wall=1)[1] == Tick()
    assert P2 not in st.ledger.weights.sync.done
    with pytest.raises(UnknownReplica):
        st.sync_done("ghost:1", 1, 2, True, now=1, wall=1)


def test_policy_leader_eviction_fails_the_sync(synced):
    st = synced
    st.deregister(P, now=1, wall=1)
    assert st.ledger.weights.sync is None and st.ledger.weights.mesh == []


def test_a_replica_that_has_not_asked_stays_out_of_the_sync():
    """A registered rollout that has not declared its version yet (still loading its
    model) would hold the broadcast until it times out: it waits for its first ask."""
    st = job()
    form(st, [P])
    train(st, 0)
    train(st, 1)  # R1 asked for prompts, R2 never did
    assert st.ledger.weights.sync is not None and st.ledger.weights.sync.members == [P, R1]
    assert R2 not in st.ledger.weights.versions and sync_for(st, R2) is None
    for rid in (P, R1):
        st.sync_done(rid, 1, 2, True, now=1, wall=1)
    assert st.ledger.weights.sync is None and st.ledger.weights.synced_version == 2
    # Its first ask declares its version before the controller decides: the reply
    # carries its order at once.
    reply = declare(st, R2, -1, now=1)
    assert reply["sync"] == {
        "seq": 2,
        "mesh_id": 2,
        "members": [P, R2],
        "rank": 1,
        "store": "p1-host:29500",
        "ordered_at": 1.0,
        "published_at": 1.0,
    }


def test_silent_members_of_a_failed_sync_wait_until_they_ask_again(synced):
    st = synced
    st.sync_done(P, 1, 2, True, now=1, wall=1)
    st.sync_done(R1, 1, -1, False, "nccl timeout", now=1, wall=1)
    # R2 may still be inside the failed broadcast: it is no longer counted.
    assert R2 not in st.ledger.weights.versions
    declare(st, R1, now=1)
    assert st.ledger.weights.sync is not None and st.ledger.weights.sync.members == [P, R1]
    assert sync_for(st, R2) is None
    assert declare(st, R2, now=1)["sync"] is None  # one sync at a time
    st.sync_done(P, 2, 2, True, now=2, wall=2)
    _, tick = st.sync_done(R1, 2, 2, True, now=2, wall=2)
    order = st.ledger.weights.sync  # R2 asked since: it gets its own at once
    assert order is not None and (order.seq, order.members) == (3, [P, R2])
    assert tick.ledger_for == {P, R1, R2}


def test_a_timed_out_sync_keeps_the_members_that_finished(synced):
    st = synced
    st.sync_done(P, 1, 2, True, now=1, wall=1)
    st.sync_done(R1, 1, 2, True, now=1, wall=1)
    limit = st.ledger.weights.timeout_s
    for now in (limit / 2, limit + 0.01):
        for rid in (P, P2, R1, R2):
            st.heartbeat(rid, now=now)
        st.tick(now=now, wall=now)
    assert "sync_failed" in kinds(st) and st.ledger.weights.sync is None
    assert (
        st.ledger.weights.versions[R1] == 2 and R2 not in st.ledger.weights.versions
    )  # R2 must ask again
    reply = declare(st, R2, now=now)
    assert reply["sync"]["members"] == [P, R2]  # R1 holds the version already


def test_no_new_order_until_the_leader_reports_the_last_one(synced):
    st = synced
    st.sync_done(R1, 1, -1, False, "nccl timeout", now=1, wall=1)
    for rid in (R1, R2):
        assert declare(st, rid, now=1)["sync"] is None  # the leader may still be sending
    assert st.tick(now=2, wall=2) == Tick() and st.ledger.weights.source_busy == (P, 1)
    st.sync_done(P2, 1, -1, False, "not mine", now=2, wall=2)  # not the leader: no matter
    assert st.ledger.weights.sync is None
    _, tick = st.sync_done(P, 1, -1, False, "peer failed", now=2, wall=2)
    assert st.ledger.weights.source_busy == (P, 2)
    order = st.ledger.weights.sync
    assert order is not None and (order.seq, order.mesh_id, order.members) == (2, 2, [P, R1, R2])
    assert tick.ledger_for == {P, R1, R2}


def test_a_sync_failed_before_its_source_took_the_order_does_not_hold_the_source(synced):
    # Seen beside a CPU hog (test_rl_sharded): the policy leader was stopped while
    # a rollout replica's request ordered a sync; the rollout failed it at the
    # rendezvous, so the order went away before the leader ever asked and saw it.
    # Waiting for the leader's report of it stalled every later sync: the rollout
    # waited for weights, and the policy for rollouts of them.
    st = synced
    st.sync_done(P, 1, 2, True, now=1, wall=1)
    st.sync_done(R1, 1, -1, False, "nccl timeout", now=1, wall=1)
    declare(st, R1, now=1)
    order = sync_for(st, R1)  # ordered in R1's reply: the leader has not seen it
    assert (order["seq"], order["members"]) == (2, [P, R1])
    st.sync_done(R1, 2, -1, False, "rendezvous timed out", now=2, wall=2)
    assert st.ledger.weights.source_busy is None
    declare(st, R1, now=2)
    order = sync_for(st, R1)
    assert (order["seq"], order["members"]) == (3, [P, R1])


def test_a_new_leader_gets_the_next_order_at_once(synced):
    st = synced
    st.sync_done(R1, 1, -1, False, "nccl timeout", now=1, wall=1)
    st.deregister(P, "crashed", now=1, wall=1)  # before it reported the sync
    for rid in (R1, R2):
        assert declare(st, rid, now=1)["sync"] is None  # no leader
    form(st, [P2], now=1, step=2)
    st.tick(now=1, wall=1)
    order = st.ledger.weights.sync
    assert order is not None and (order.seq, order.members) == (2, [P2, R1, R2])
    assert order.store == "p2-host:29500" and st.ledger.weights.source_busy == (P2, 2)


# -- the sync's source: a rollout peer for joiners; the first mesh waits for n_init --------


def relaying(*overrides: str) -> CheckedState:
    """Leader P, rollouts R1 and R2 that relay, both synced to version 2 by the leader."""
    st = job(*overrides, rollouts=())
    for n in ("r1", "r2"):
        join(st, "rollout", n, relays=True)
    declare(st, R1)
    declare(st, R2)
    form(st, [P])
    train(st, 0)
    train(st, 1)
    order = st.ledger.weights.sync
    # Nobody holds version 2 yet: the policy leader is the source.
    assert order is not None and order.members == [P, R1, R2] and order.source_role == "policy"
    for rid in (P, R1, R2):
        st.sync_done(rid, 1, 2, True, now=1, wall=1)
    assert st.ledger.weights.sync is None
    return st


def test_a_joiner_gets_its_weights_from_an_idle_rollout_peer():
    st = relaying()
    r3 = join(st, "rollout", "r3", now=2, relays=True)
    reply = lease(st, r3, version=-1, now=2)
    assert reply["lease"] is None
    assert reply["sync"] == {
        "seq": 2,
        "mesh_id": 2,
        "members": [R1, r3],  # R1 holds version 2: it relays it; the leader trains on
        "rank": 1,
        "store": "r1-host:29500",
        "ordered_at": 2.0,
        "published_at": 2.0,
    }
    assert sync_for(st, R1) == {**reply["sync"], "rank": 0} and sync_for(st, P) is None
    ordered = [e for e in st.events if e["kind"] == "sync_ordered"][-1]
    assert (ordered["source"], ordered["source_role"]) == (R1, "rollout")
    st.sync_done(R1, 2, 2, True, now=3, wall=3)
    st.sync_done(r3, 2, 2, True, now=3, wall=3)
    assert st.ledger.weights.sync is None and st.ledger.weights.versions[r3] == 2
    done = st.events[-1]
    assert (done["kind"], done["source"], done["source_role"]) == ("sync_done", R1, "rollout")
    timeline = st.status(3).model_dump(mode="json")["overview"]["timeline"]
    assert timeline[-1]["text"] == f"weight sync 2 done (v2 relayed by rollout {R1} to 1)"
    assert "weight sync 1 done (v2)" in [t["text"] for t in timeline]  # the leader's
    assert lease(st, r3, version=2, now=3)["lease"] is not None


def test_a_joiner_gets_the_leader_when_every_peer_is_busy_or_cannot_relay():
    st = relaying()
    lease(st, R1, 2, version=2, now=2)  # both peers generate
    lease(st, R2, 2, version=2, now=2)
    r3 = join(st, "rollout", "r3", now=2)
    order = lease(st, r3, version=-1, now=2)["sync"]
    assert (order["members"], order["store"]) == ([P, r3], "p1-host:29500")
    assert st.ledger.weights.sync.source_role == "policy"
    # Peers that do not relay (another weight channel) are never a source.
    st = job()
    declare(st, R1)
    declare(st, R2)
    form(st, [P])
    train(st, 0)
    train(st, 1)
    for rid in (P, R1, R2):
        st.sync_done(rid, 1, 2, True, now=1, wall=1)
    r3 = join(st, "rollout", "r3", now=2)
    assert lease(st, r3, version=-1, now=2)["sync"]["members"] == [P, r3]


def test_a_joiner_gets_the_last_synced_version_from_a_peer_while_the_policy_is_down():
    st = relaying()
    train(st, 2, version=2, now=2)
    train(st, 3, version=2, now=2)  # version 4 wanted; its sync is ordered
    assert st.ledger.weights.want_version == 4 and st.ledger.weights.sync is not None
    st.deregister(P, "crashed", now=3, wall=3)  # the only policy replica: no leader
    assert st.ledger.weights.sync is None
    declare(st, R1, 2, now=3)  # the failed sync's members ask again, still at version 2
    declare(st, R2, 2, now=3)
    r3 = join(st, "rollout", "r3", now=3)
    order = lease(st, r3, version=-1, now=3)["sync"]
    assert (order["members"], order["store"]) == ([R1, r3], "r1-host:29500")
    st.sync_done(R1, order["seq"], 2, True, now=4, wall=4)
    st.sync_done(r3, order["seq"], 2, True, now=4, wall=4)
    assert st.ledger.weights.versions[r3] == 2 and st.ledger.weights.synced_version == 2
    assert st.tick(now=4, wall=4) == Tick() and st.ledger.weights.sync is None  # nothing newer


def test_no_peer_relays_the_init_weights():
    """Version 0 was built from config by each replica: no channel keeps a copy."""
    st = job("roles.rollout.n_init_replicas=1", rollouts=())
    r1 = join(st, "rollout", "r1", relays=True)
    declare(st, r1)
    form(st, [P])
    train(st, 0, rid=r1)
    train(st, 1, rid=r1)  # version 2 wanted: r1 is in its sync (with the leader)
    st.deregister(P, "crashed", now=1, wall=1)
    r2 = join(st, "rollout", "r2", now=1, relays=True)
    assert lease(st, r2, version=-1, now=1)["sync"] is None
    assert st.ledger.weights.sync is None


def test_a_peer_that_cannot_relay_fails_the_sync_and_the_next_goes_elsewhere():
    st = relaying()
    r3 = join(st, "rollout", "r3", now=2)
    assert lease(st, r3, version=-1, now=2)["sync"]["members"] == [R1, r3]
    # R1's channel kept no buffer of that version: it says so, and the sync fails.
    st.sync_done(R1, 2, 2, False, "cannot relay version 2", now=3, wall=3)
    assert st.ledger.weights.sync is None and "sync_failed" in kinds(st)
    declare(st, r3, -1, now=3)  # it asks again
    # R1 is free again (it reported): the next order may name R1 or R2, both at v2.
    order = st.ledger.weights.sync
    assert order is not None and order.members[1:] == [r3] and order.source_role == "rollout"


def test_the_first_mesh_waits_for_the_rollout_roles_n_init_replicas():
    st = job("roles.rollout.n_init_replicas=3", rollouts=("r1", "r2", "r3"))
    declare(st, R1)  # r1 generates at version 0 meanwhile; r2 and r3 still load
    form(st, [P])
    train(st, 0)
    train(st, 1)
    assert st.ledger.weights.want_version == 2 and st.ledger.weights.sync is None
    assert lease(st, R1, 2, version=0, now=1)["lease"] is not None  # it goes on generating
    declare(st, R2, now=2)
    assert st.ledger.weights.sync is None  # 2 of 3
    reply = declare(st, "r3:i0", now=3)
    assert reply["sync"]["members"] == [P, R2, "r3:i0"]  # R1 holds a lease: next sync
    assert "sync_short" not in kinds(st)


def test_the_first_mesh_goes_ahead_short_after_quorum_s():
    st = job("roles.rollout.n_init_replicas=3")
    declare(st, R1)
    form(st, [P])
    train(st, 0)
    train(st, 1)
    declare(st, R1, version=0, now=QUORUM_S - 1)
    assert st.ledger.weights.sync is None
    declare(st, R1, version=0, now=QUORUM_S)  # held since the commit at 0
    order = st.ledger.weights.sync
    assert order is not None and order.members == [P, R1]
    short = [e for e in st.events if e["kind"] == "sync_short"]
    assert [(e["up"], e["n_init"]) for e in short] == [(1, 3)]
    text = st.status(70).model_dump(mode="json")["overview"]["timeline"]
    assert any(t["text"].startswith("first weight sync went ahead with 1 of 3") for t in text)


# -- scale, status, restore ---------------------------------------------------------------


def test_set_desired_is_shown_and_journaled(st, journal):
    assert st.set_desired("rollout", 5, now=0, wall=0) == {"rollout": 5}
    assert st.set_desired("policy", 2, now=0, wall=0) == {"rollout": 5, "policy": 2}
    roles = st.status(0).model_dump(mode="json")["roles"]
    assert (roles["policy"]["desired"], roles["rollout"]["desired"]) == (2, 5)
    assert st.events[-1] == {
        "seq": st.event_seq,
        "kind": "scale",
        "at": 0,
        "role": "policy",
        "replicas": 2,
    }
    with pytest.raises(StateError) as e:
        st.set_desired("critic", 1, now=0, wall=0)
    assert e.value.field == "role"
    journal.write([(t, k, r) for t, rows in st.tables.items() for k, r in rows.items()])
    new = ControllerState.restore(st.cfg, journal.load(), now=1)
    assert new.desired == {"rollout": 5, "policy": 2}
    assert new.status(1).model_dump(mode="json")["roles"]["rollout"]["desired"] == 5


def test_status_shows_the_ledger(synced):
    st = synced
    rl = st.status(0).model_dump(mode="json")["rl"]
    assert rl["ok"] and rl["prompts"]["trained"] == 2 * PPS
    assert rl["rollouts"] == check(st)["rollouts"]
    assert rl["leases"] == check(st)["leases"]
    assert (rl["policy_step"], rl["next_batch"], rl["finished"]) == (2, 2, False)
    assert [h["batch"] for h in rl["history"]] == [0, 1]
    assert rl["last"] == rl["history"][-1]
    w = rl["weights"]
    assert (w["want_version"], w["synced_version"], w["mesh_id"]) == (2, 0, 1)
    assert w["sync_in_flight"]["members"] == [P, R1, R2]
    assert w["versions"] == {R1: 0, R2: 0}
    assert rl["leased_by"] == {}
    lease(st, R1, 3)
    lease(st, R2, 2)
    assert st.status(0).model_dump(mode="json")["rl"]["leased_by"] == {R1: 3, R2: 2}
    json.dumps(st.status(0).model_dump(mode="json"))  # served as JSON


def test_history_is_bounded():
    st = job("rl.loop.history=10", "rl.loop.target_exact_match=null")
    for step in range(12):
        train(st, step)
    assert [h["batch"] for h in st.ledger.rollouts.history] == list(range(2, 12))
    assert sorted(st.tables["rl_history"], key=int) == [str(i) for i in range(2, 12)]


def test_restore_rebuilds_the_ledger(journal):
    st = job(
        "rl.grpo.prompts_per_step=2",
        "rl.loop.max_staleness=1",
        "rl.loop.sync_every=1",
        "rl.loop.max_ahead=1",
        journal=journal,
    )
    run_ahead(st)
    form(st, [P])
    lease(st, R1, 4)
    submit(st, R1, "L1", ["p0.0", "p1.0", "p2.0"])  # p3 stays leased
    st.lease_batch(P, 0, now=0, wall=0)
    st.ack_batch(P, 1, now=0, wall=0)  # batch 0 trained: history; a sync is ordered
    st.lease_batch(P, 1, now=0, wall=0)  # waits for a second rollout
    lease(st, R2, 2, version=1)  # p4, p5
    st.tick(now=LEASE_S, wall=LEASE_S)  # p3, p4, p5 expire
    submit(st, R2, "L2", ["p4.0"], version=1, now=LEASE_S)  # late, accepted
    st.lease_batch(P, 1, now=LEASE_S, wall=LEASE_S)  # batch 1 = p2, p4 (frozen, untrained)
    lease(st, R1, 1, version=1, now=LEASE_S)  # p5 again (the last expired lease goes first)
    submit(st, R2, "L2", ["p4.0"], version=1, now=LEASE_S)  # a duplicate
    st.set_desired("rollout", 3, now=LEASE_S, wall=LEASE_S)
    led = st.ledger
    assert (led.prompts.cursor, list(led.prompts.requeue), list(led.prompts.leases)) == (
        6,
        [3],
        ["L3"],
    )
    assert list(led.rollouts.batches) == [1] and led.weights.sync is not None
    before = durable(led)

    new = restart(st, journal, now=100.0)

    assert durable(new.ledger) == before
    assert new.ledger.balance() == led.balance()
    assert new.ledger.prompts.leases["L3"].deadline == 100.0 + LEASE_S  # a fresh deadline
    assert new.ledger.weights.sync is None and new.ledger.weights.versions == {}  # not durable
    assert new.desired == {"rollout": 3}
    # It goes on where it left off: the same frozen batch, the requeue, then the cursor.
    reply, _ = new.lease_batch(P, 1, now=100, wall=100)
    assert [r["rollout_id"] for r in reply["batch"]["rollouts"]] == ["p2.0", "p4.0"]
    assert ids(lease(new, R2, 2, version=1, now=100)) == ["p3.0", "p6.0"]
    assert new.tick(now=100 + LEASE_S - 0.01, wall=100).ledger_for == set()
    new.ack_batch(P, 2, now=100, wall=100)
    assert [h["batch"] for h in new.ledger.rollouts.history] == [0, 1]
    assert check(new)["prompts"]["trained"] == 4


def test_restore_without_a_ledger_in_the_journal(journal):
    st = CheckedState.restore(make_cfg(), journal.load(), now=0)
    assert durable(st.ledger) == durable(Ledger(st.cfg.rl, ChangeLog(100), run="fresh"))
    assert check(st)["prompts"]["issued"] == 0


# -- payloads -----------------------------------------------------------------------------


def test_payloads_go_to_the_payload_log_and_leave_it_when_trained_or_discarded(st):
    """The ledger journals each rollout's summary and the ref of its payload; the
    payload (the completions) is written to the payload log, and dropped from it
    once the rollout is trained or discarded."""
    ids_ = fill(st, PPS)
    assert sorted(st.payloads) == sorted(f"rl/{r}" for r in ids_)
    recs = st.tables["rollouts"]
    assert all("completions" not in rec for rec in recs.values())
    assert {rec["ref"] for rec in recs.values()} == set(ids_)
    batch = st.lease_batch(P, 0, now=0, wall=0)[0]["batch"]
    assert (
        batch["rollouts"][0]["completions"]
        == rollout(batch["rollouts"][0]["rollout_id"])["completions"]
    )
    st.ack_batch(P, 1, now=0, wall=0)
    assert st.payloads == {}  # trained: nothing refers to them any more
    reply = lease(st, R1, 2)
    out = submit(st, R1, reply["lease"]["lease_id"], ids(reply), version=-10 + 2)
    assert out["stale"] == ids(reply) and st.payloads == {}  # stale: never kept


def test_a_lost_payload_is_discarded_and_its_batch_frozen_again_without_it(st):
    fill(st, PPS + 1)
    first = st.lease_batch(P, 0, now=0, wall=0)[0]["batch"]
    lost = first["rollouts"][1]["rollout_id"]
    out, tick = st.lost_payloads(P, [(lost, "payload_corrupt")], now=1, wall=1)
    assert out == {"discarded": [lost], "reopened": [0]}
    assert tick.ledger_for >= {R1, R2}  # its prompt is dispatched again
    assert check(st)["rollouts"]["discarded"] == {"payload_corrupt": 1}
    assert st.ledger.prompts.by_index[int(lost[1:].split(".")[0])].state == "queued"
    # Asked again for step 0, the batch is frozen anew (no rewind: nothing trained).
    again = st.lease_batch(P, 0, now=1, wall=1)[0]["batch"]
    ids_again = [r["rollout_id"] for r in again["rollouts"]]
    assert again["index"] == 0 and lost not in ids_again and len(ids_again) == PPS
    assert "policy_rewind" not in kinds(st)
    # A second report of it changes nothing.
    assert st.lost_payloads(P, [(lost, "payload_missing")], now=1, wall=1)[0]["discarded"] == []


def test_a_restart_discards_rollouts_whose_payloads_the_log_lost(journal):
    st = job(journal=journal)
    ids_ = fill(st, PPS)
    st.payloads.pop(f"rl/{ids_[0]}")  # a torn write, a lost segment
    new = restart(st, journal, now=1)
    new.reconcile(now=1, wall=1)
    assert check(new)["rollouts"]["discarded"] == {"payload_missing": 1}
    assert ids_[0] not in new.ledger.rollouts.records
    assert sorted(new.payload_keys()) == sorted(f"rl/{r}" for r in ids_[1:])


def test_a_journal_written_before_the_payload_log_moves_its_payloads_out(journal):
    """Rollout records that still hold their completions (a journal from before the
    payload log) restore as before: the completions move to the payload log and the
    record keeps the ref instead."""
    st = job(journal=journal)
    ids_ = fill(st, 2)
    tables = journal.load()
    for rid in ids_:  # as an older controller journaled them
        rec = tables["rollouts"][rid]
        rec.pop("ref")
        rec["completions"] = rollout(rid)["completions"]
    new = ControllerState.restore(st.cfg, tables, now=1)
    assert sorted(k for k, _ in new.moved) == sorted(f"rl/{r}" for r in ids_)
    assert dict(new.moved)[f"rl/{ids_[0]}"]["completions"] == rollout(ids_[0])["completions"]
    changed = {k: rec for tbl, k, rec in new.drain() if tbl == "rollouts"}
    assert set(changed) == set(ids_)
    assert all(rec["ref"] == k and "completions" not in rec for k, rec in changed.items())


def test_a_source_that_dies_after_every_receiver_had_the_weights_completed_the_sync():
    """The policy leader sent version 4 and died before reporting it (CI found a late
    joiner then waiting forever: the controller still believed version 2 was the last
    synced, while the peers held 4)."""
    st = relaying()
    train(st, 2, version=2, now=2)
    train(st, 3, version=2, now=2)  # version 4 wanted: the leader sends it to R1 and R2
    seq = st.ledger.weights.sync.seq
    st.sync_done(R1, seq, 4, True, now=3, wall=3)
    st.sync_done(R2, seq, 4, True, now=3, wall=3)
    st.deregister(P, "crashed", now=3, wall=3)  # before its own report
    assert st.ledger.weights.sync is None and st.ledger.weights.synced_version == 4
    assert "sync_failed" not in kinds(st)
    r3 = join(st, "rollout", "r3", now=3, relays=True)
    order = lease(st, r3, version=-1, now=3)["sync"]
    assert order["members"][1:] == [r3] and order["members"][0] in (R1, R2)


def test_a_joiner_gets_the_newest_version_a_peer_holds_when_the_policy_is_down():
    """The same, with the leader evicted before the receivers reported: the sync failed,
    but the peers hold version 4 and say so when they ask again; a joiner gets 4."""
    st = relaying()
    train(st, 2, version=2, now=2)
    train(st, 3, version=2, now=2)
    st.deregister(P, "crashed", now=3, wall=3)
    assert st.ledger.weights.synced_version == 2
    declare(st, R1, 4, now=3)  # it had received version 4 before the source died
    declare(st, R2, 2, now=3)  # (this one had not): R1 relays 4 to it
    order = st.ledger.weights.sync
    assert order is not None and order.members == [R1, R2] and order.source_role == "rollout"
    st.sync_done(R1, order.seq, 4, True, now=4, wall=4)
    st.sync_done(R2, order.seq, 4, True, now=4, wall=4)
    r3 = join(st, "rollout", "r3", now=4, relays=True)
    order = lease(st, r3, version=-1, now=4)["sync"]
    assert order["members"][1:] == [r3] and order["members"][0] in (R1, R2)
    assert st.ledger.weights.synced_version == 4

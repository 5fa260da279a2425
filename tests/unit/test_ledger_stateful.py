"""Hypothesis drives the RL ledger through random leases, submissions (partial,
late, duplicate, stale), lease expiry, evictions, batch freezes, acks, weight
syncs and controller restarts (through a real SQLite journal).

After every call :class:`~test_ledger.CheckedState` checks the balance, where
each prompt and rollout is, and that the journal rebuilds the very same ledger;
the rules here add what holds across calls: counters only grow, a rollout id is
accepted once, a prompt is trained once.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_ledger import CheckedState, make_cfg, rollout

from phalanx.controller.core.state import StateError, UnknownReplica
from phalanx.controller.journal import SqliteJournal as Journal
from phalanx.protocol.rl import parse_rollout_id

HEARTBEAT_S = 10.0
LEASE_S = 5.0
IE = 2
CFG = make_cfg(
    "rl.grpo.prompts_per_step=2",
    "rl.grpo.group_size=2",
    f"rl.grpo.inner_epochs={IE}",
    "rl.grpo.steps=5",
    f"rl.loop.lease_s={LEASE_S}",
    "rl.loop.max_ahead=2",
    "rl.loop.sync_every=2",
    "rl.loop.max_staleness=4",
    "rl.loop.window=2",
    "rl.loop.target_exact_match=0.9",
)
NAMES = ("a", "b", "c")
SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
# Small steps stay inside every deadline; the others cross lease_s, heartbeat_s, or both.
CLOCK_STEPS = st.sampled_from([0.0, 1.0, LEASE_S + 0.5, HEARTBEAT_S + 0.5])
COUNTS = ("accepted", "duplicates", "trained_prompts", "trained_rollouts", "leases_issued")


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._dir = tempfile.TemporaryDirectory(dir=SCRATCH)
        self.journal = Journal(Path(self._dir.name) / "j.sqlite")
        self.now = 0.0
        self.state = CheckedState(CFG, self.journal)
        self.state.start(0.0, 0.0)
        self.incarnation = 0
        self.leases: list[tuple[str, str, list[str], int]] = []
        """Every lease handed out: (holder, lease id, rollout ids, version)."""
        self.accepted: set[str] = set()
        self.trained: set[int] = set()
        self.batched: set[int] = set()
        self.seen: dict[str, int] = {}

    def teardown(self) -> None:
        self.journal.close()
        self._dir.cleanup()

    @property
    def led(self) -> Any:
        return self.state.ledger

    def live(self, role: str) -> list[str]:
        return sorted(self.state.roles[role].member_ids)

    def register(self, role: str, name: str) -> str:
        self.incarnation += 1
        m, _ = self.state.register(
            role, name, f"i{self.incarnation}", now=self.now, wall=self.now, address=f"{name}:1"
        )
        return m.replica_id

    def version(self, mode: str) -> int:
        led = self.led
        return {
            "none": -1,
            "init": 0,
            "floor": max(0, led.rollouts.floor()),
            "newest": max(led.policy_step, led.weights.synced_version),
        }[mode]

    # -- rules -------------------------------------------------------------

    @initialize(rollouts=st.integers(1, 3), rounds=st.integers(0, 4))
    def populate(self, rollouts: int, rounds: int) -> None:
        """A few replicas, and a few rounds of the happy path, so that the rules start
        from trained batches and weight syncs as often as from an empty ledger."""
        self.join_policy()
        for name in NAMES[:rollouts]:
            self.register("rollout", name)
        for _ in range(rounds * IE):
            if self.led.weights.sync is not None:
                self.sync_done(0, True, True)
            self.generate(0, 2, 0.5)
            self.train(True)
            self.trained_once()

    @rule()
    def join_policy(self) -> None:
        """A policy replica (re)starts and the live ones form a quorum: a leader."""
        self.register("policy", "p")
        for rid in self.live("policy"):
            step = self.led.policy_step
            # Its state was committed in the role's last quorum (the lineage).
            lineage = self.state.roles["policy"].quorum_id
            self.state.request_quorum(
                rid, step, f"q{self.incarnation}", 60, now=self.now, wall=self.now, lineage=lineage
            )

    @rule(name=st.sampled_from(NAMES))
    def join_rollout(self, name: str) -> None:
        self.register("rollout", name)

    @precondition(lambda self: self.live("rollout"))
    @rule(i=st.integers(0, 9))
    def leave(self, i: int) -> None:
        rids = self.live("rollout")
        self.state.deregister(rids[i % len(rids)], "test", now=self.now, wall=self.now)

    @precondition(lambda self: self.live("rollout"))
    @rule(
        i=st.integers(0, 9),
        n=st.integers(1, 5),
        mode=st.sampled_from(["none", "init", "floor", "newest"]),
    )
    def lease(self, i: int, n: int, mode: str) -> None:
        rids = self.live("rollout")
        rid = rids[i % len(rids)]
        version = self.version(mode)
        reply, _ = self.state.lease_prompts(rid, version, n, now=self.now, wall=self.now)
        le = reply["lease"]
        if le is None:
            return
        assert not self.led.finished and version >= max(0, self.led.rollouts.floor())
        assert 1 <= len(le["prompts"]) <= n
        rolls = [p["rollout_id"] for p in le["prompts"]]
        assert not set(rolls) & self.accepted
        self.leases.append((rid, le["lease_id"], rolls, version))

    @precondition(lambda self: self.live("rollout"))
    @rule(i=st.integers(0, 9), n=st.integers(1, 3), exact=st.sampled_from([0.0, 0.5, 1.0, 1.0]))
    def generate(self, i: int, n: int, exact: float) -> None:
        """The happy path: a replica with the newest weights leases and submits at once."""
        self.lease(i, n, "newest")
        if self.leases and self.leases[-1][0] in self.state.members:
            self.submit(0, [True], 0, exact, False)

    @precondition(lambda self: self.leases and self.live("rollout"))
    @rule(
        k=st.integers(0, 99),
        keep=st.lists(st.booleans(), min_size=1, max_size=5),
        older=st.sampled_from([0, 0, 0, 3]),
        exact=st.floats(0, 1),
        twice=st.booleans(),
    )
    def submit(self, k: int, keep: list[bool], older: int, exact: float, twice: bool) -> None:
        """Submit some of a lease's rollouts: the newest lease or an old (maybe expired,
        maybe already submitted) one, made with its version or an older one."""
        holder, lease_id, rids, version = self.leases[-1 - k % len(self.leases)]
        own = holder in self.state.members
        if not own:  # another replica submits under the lease: refused as unleased
            holder = self.live("rollout")[k % len(self.live("rollout"))]
        chosen = [r for r, b in zip(rids, keep * len(rids), strict=False) if b] or rids[:1]
        if twice:
            chosen = chosen + chosen[:1]
        v = max(0, version - older)
        rolls = [rollout(r, v, exact_match=round(exact, 2)) for r in chosen]
        before = self.led.counts["accepted"]
        out, _ = self.state.submit_rollouts(holder, lease_id, rolls, now=self.now, wall=self.now)
        verdicts = out["accepted"] + out["duplicate"] + out["stale"] + out["unleased"]
        assert sorted(verdicts) == sorted(chosen)
        assert not out["unleased"] if own else not out["accepted"] + out["stale"]
        got = out["accepted"] + out["stale"]
        assert not set(got) & self.accepted, "a rollout id accepted twice"
        assert len(set(got)) == len(got)
        self.accepted |= set(got)
        assert self.led.counts["accepted"] == before + len(got)

    @precondition(lambda self: self.live("policy"))
    @rule(ahead=st.sampled_from([0, 0, 0, 0, 1, -IE, None]))
    def lease_batch(self, ahead: int | None) -> None:
        """The leader asks for the batch of its step (or of one ahead, one behind, or
        step 0: a fresh policy after the whole role was lost)."""
        step = 0 if ahead is None else max(0, self.led.policy_step + ahead)
        reply, _ = self.state.lease_batch(self.live("policy")[0], step, now=self.now, wall=self.now)
        b = reply["batch"]
        if b is not None:
            assert b["index"] == step // IE
            assert len(b["rollouts"]) == 2
            again, _ = self.state.lease_batch(
                self.live("policy")[-1], step, now=self.now, wall=self.now
            )
            assert again["batch"] == b, "two policy replicas got different batches"

    @precondition(lambda self: self.live("policy"))
    @rule(commit=st.booleans())
    def train(self, commit: bool) -> None:
        """The happy path: the policy asks for the batch of its step and commits it."""
        step = self.led.policy_step
        self.lease_batch(0)
        self.trained_once()  # what the batch lease trained; then what the commit trains
        if commit and step // IE in self.led.rollouts.batches:
            self.state.ack_batch(self.live("policy")[0], step + 1, now=self.now, wall=self.now)

    @precondition(lambda self: self.live("policy"))
    @rule(extra=st.sampled_from([1, 1, 0]))
    def ack(self, extra: int) -> None:
        """The policy commits the step it holds a batch for (``extra`` 0: a retried ack)."""
        led = self.led
        if led.policy_step // IE in led.rollouts.batches:
            step = led.policy_step + extra
            self.state.ack_batch(self.live("policy")[0], step, now=self.now, wall=self.now)

    @precondition(lambda self: self.state.ledger is not None and self.state.ledger.weights.sync)
    @rule(i=st.integers(0, 9), ok=st.sampled_from([True, True, False]), everyone=st.booleans())
    def sync_done(self, i: int, ok: bool, everyone: bool) -> None:
        """One member of the in-flight sync reports (or every member, successfully)."""
        s = self.led.weights.sync
        version = max(self.led.weights.want_version, self.led.weights.synced_version)
        before = self.led.weights.synced_version
        members = list(s.members) if everyone else [s.members[i % len(s.members)]]
        for rid in members:
            ok = ok or everyone
            err = "" if ok else "boom"
            self.state.sync_done(rid, s.seq, version, ok, err, now=self.now, wall=self.now)
        assert self.led.weights.synced_version >= before
        if everyone:  # complete: the next sync, if any, is a new one
            assert self.led.weights.sync is None or self.led.weights.sync.seq > s.seq
            assert self.led.weights.synced_version >= min(before, *s.done.values())

    @rule(dt=CLOCK_STEPS, silent=st.sampled_from([None, None, None, "policy", "rollout"]))
    def tick(self, dt: float, silent: str | None) -> None:
        """Time passes; every replica heartbeats except, maybe, those of one role."""
        self.now += dt
        for role in ("policy", "rollout"):
            if role != silent:
                for rid in self.live(role):
                    self.state.heartbeat(rid, now=self.now)
        self.state.tick(now=self.now, wall=self.now)
        assert all(le.deadline > self.now for le in self.led.prompts.leases.values())

    @rule(dt=st.sampled_from([0.0, 1.0]))
    def restart(self, dt: float) -> None:
        self.now += dt
        self.journal.close()
        self.journal = Journal(Path(self._dir.name) / "j.sqlite")
        old = self.state
        new = CheckedState.restore(CFG, self.journal.load(), self.now)
        assert isinstance(new, CheckedState)
        new.tables, new.journal = self.journal.load(), self.journal
        new.start(self.now, self.now)
        assert new.ledger.balance() == old.ledger.balance()
        self.state = new

    @rule(i=st.integers(0, 9))
    def refused(self, i: int) -> None:
        """Requests the ledger must refuse leave everything as it was."""
        rids = self.live("rollout")
        try:
            if rids:
                bad = rollout("p0.0", 0, group=1)
                self.state.submit_rollouts(
                    rids[i % len(rids)], "L1", [bad], now=self.now, wall=self.now
                )
            else:
                self.state.lease_prompts("ghost:0", 0, 1, now=self.now, wall=self.now)
        except (StateError, UnknownReplica):
            assert self.state.last_changes == []
        else:
            raise AssertionError("refused request accepted")

    # -- invariants --------------------------------------------------------

    @invariant()
    def counters_only_grow(self) -> None:
        """Counters only grow, but for the trained ones, which a rollback takes back:
        each prompt it takes back is one more discard (``rolled_back``), and the
        lineage holds exactly the trained rollouts."""
        led = self.led
        now = {
            **{k: led.counts[k] for k in COUNTS},
            "cursor": led.prompts.cursor,
            "lease_seq": led.prompts.lease_seq,
            "seq": led.rollouts.seq,
            "sync_seq": led.weights.sync_seq,
            "mesh_id": led.weights.mesh_id,
            "discarded": sum(led.rollouts.discarded.values()),
            "rolled_back": led.rollouts.discarded.get("rolled_back", 0),
        }
        back = now["rolled_back"] - self.seen.get("rolled_back", 0)
        for k, v in now.items():
            if k in ("trained_prompts", "trained_rollouts"):
                assert v >= self.seen.get(k, 0) - back, k
            else:
                assert v >= self.seen.get(k, 0), k
        assert led.rollouts.lineage.rollouts() == led.counts["trained_rollouts"]
        self.seen = now

    @invariant()
    def sync_members_declared(self) -> None:
        """A sync counts only on rollouts that declared their version (and are live)."""
        s = self.led.weights.sync
        if s is not None:
            assert all(r in self.led.weights.versions for r in s.members[1:])
            assert set(s.members[1:]) <= set(self.live("rollout"))

    @invariant()
    def trained_once(self) -> None:
        """Prompts leave the ledger only by training (an ack, or a batch lease that
        covers a lost ack), and only from a frozen batch: into the lineage, once each.
        A rollback takes them back out of it, into the ledger again."""
        led = self.led
        gone = self.batched - set(led.prompts.by_index)
        lineage = [
            parse_rollout_id(rid)[0] for ids in led.rollouts.lineage.batches.values() for rid in ids
        ]
        assert len(lineage) == len(set(lineage)), "a prompt trained twice"
        assert set(lineage).isdisjoint(led.prompts.by_index)
        assert gone <= set(lineage)
        self.trained = set(lineage)
        assert led.counts["trained_prompts"] == len(self.trained)
        self.batched = {
            led.rollouts.records[rid]["prompt"]
            for b in led.rollouts.batches.values()
            for rid in b["rollout_ids"]
        }


LedgerMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=40, deadline=None)
test_ledger_state_machine = LedgerMachine.TestCase

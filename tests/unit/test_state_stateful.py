"""Hypothesis drives the controller's state machine through random joins,
leaves, heartbeats, quorum requests, failure reports, clock jumps and
controller restarts (through a real SQLite journal), and checks the quorum
invariants after every call.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from phalanx.config import JobConfig, load_config
from phalanx.controller.core.base import Conflict, Tick
from phalanx.controller.core.records import RoleState
from phalanx.controller.core.state import ControllerState
from phalanx.controller.journal import SqliteJournal as Journal
from phalanx.protocol.membership import Quorum

ROLES = ("policy", "rollout")
NAMES = ("a", "b", "c", "d", "e")
HEARTBEAT_S = 10.0
CFG = load_config(
    overrides=[
        f"timeouts.heartbeat_s={HEARTBEAT_S}",
        "timeouts.suspect_grace_s=0.25",
        "roles.policy.min_replicas=2",
        "roles.policy.n_init_replicas=3",
        "roles.policy.join_timeout_s=1.0",
        "roles.rollout.min_replicas=1",
        "roles.rollout.n_init_replicas=1",
        "roles.rollout.join_timeout_s=0.5",
    ]
)
# A journal per example, on tmpfs where there is one: a disk's fsyncs would make
# the few hundred controller restarts of a run take seconds.
SCRATCH = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
# Small steps stay inside every timeout; large ones cross join_timeout,
# suspect_grace_s, heartbeat_s, or all of them at once.
CLOCK_STEPS = st.sampled_from([0.0, 0.01, 0.2, 0.3, 0.6, 1.2, 5.0, HEARTBEAT_S + 0.5, 1000.0])


class RecordingState(ControllerState):
    """Records the role's live members at the exact moment each quorum forms."""

    def __init__(self, cfg: JobConfig, **kwargs: Any):
        super().__init__(cfg, **kwargs)
        self.formations: list[tuple[Quorum, frozenset[str]]] = []
        form = self.quorums.try_form

        def recorded(rs: RoleState, now: float, wall: float) -> Quorum | None:
            live = frozenset(rs.member_ids)
            q = form(rs, now, wall)
            if q is not None:
                self.formations.append((q, live))
            return q

        self.quorums.try_form = recorded  # type: ignore[method-assign]


class ControllerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self._dir = tempfile.TemporaryDirectory(dir=SCRATCH)
        self.journal = Journal(Path(self._dir.name) / "journal.sqlite")
        self.now = 0.0
        self.state = RecordingState(CFG)
        self.state.start(self.now, self.now)
        self.journal.write(self.state.drain())
        self.incarnation = 0
        self.request_seq = 0
        # Run-wide records, kept across controller restarts.
        self.membership: dict[tuple[str, int], frozenset[str]] = {}
        self.last_formed: dict[str, Quorum | None] = dict.fromkeys(ROLES)
        self.failed_commit: dict[str, bool] = dict.fromkeys(ROLES, False)
        self.seen_quorum_id = dict.fromkeys(ROLES, 0)
        self.seen_round = dict.fromkeys(ROLES, 0)
        self.seen_step = dict.fromkeys(ROLES, 0)
        self.evicted: set[str] = set()
        self.answers: dict[tuple[str, str], Quorum] = {}
        self.last_request: dict[str, str] = {}

    def teardown(self) -> None:
        self.journal.close()
        self._dir.cleanup()

    # -- helpers -----------------------------------------------------------

    def live(self, role: str | None = None) -> list[str]:
        return sorted(
            rid for rid, m in self.state.members.items() if role is None or m.role == role
        )

    def pick(self, i: int, role: str | None = None) -> str:
        ids = self.live(role)
        return ids[i % len(ids)]

    def settle(self, tick: Tick, *, adds_member: bool = False) -> None:
        """Journal the call's changes, as the server does before answering, then
        check every quorum the call formed."""
        self.journal.write(self.state.drain())
        recorded, self.state.formations = self.state.formations, []
        assert [q for q, _ in recorded] == tick.formed
        evicted_now = set(tick.evicted)
        for q, live_at_formation in recorded:
            self.check_formed(q, live_at_formation, evicted_now, adds_member)
        assert not (evicted_now & self.evicted), "a replica was evicted twice"
        self.evicted |= evicted_now
        for rid in tick.evicted:
            self.last_request.pop(rid, None)

    def check_formed(
        self, q: Quorum, live: frozenset[str], evicted_now: set[str], adds_member: bool
    ) -> None:
        role = q.role
        ids = frozenset(q.replica_ids)
        rules = CFG.roles[role]
        first = self.last_formed[role] is None
        # Size: n_init_replicas for the role's first quorum, min_replicas after.
        assert len(ids) >= (rules.n_init_replicas if first else rules.min_replicas)
        # Split-brain guard, exactly at formation and as seen from outside the call:
        # membership only shrinks inside a call (register adds one, after its eviction).
        assert ids <= live
        assert 2 * len(ids) > len(live)
        live_after = len(self.live(role)) - (1 if adds_member else 0)
        assert 2 * len(ids) > live_after
        # Evicted incarnations never come back; one may fall later in this very call.
        assert not ids & self.evicted
        assert ids <= set(self.state.members) | evicted_now
        # quorum_id: one id names one membership for the whole run.
        key = (role, q.quorum_id)
        assert self.membership.setdefault(key, ids) == ids, "quorum_id reused for new members"
        # quorum_id changes iff membership changed or a commit failed; round always moves.
        # A rollback (a round behind the role's step, with nobody left who may hold
        # it) is a new quorum_id too, and the only way the role's step goes back.
        prev = self.last_formed[role]
        rolled = q.rolled_back_from is not None
        if prev is None:
            assert q.quorum_id > self.seen_quorum_id[role]
        elif ids != frozenset(prev.replica_ids) or self.failed_commit[role] or rolled:
            assert q.quorum_id > prev.quorum_id
        else:
            assert q.quorum_id == prev.quorum_id
        assert q.round == (prev.round if prev else 0) + 1
        assert q.max_step == max(m.step for m in q.members)
        if rolled:
            assert q.rolled_back_from == self.seen_step[role] > q.max_step == q.job_step
            assert self.state.roles[role].rollbacks[-1]["quorum_id"] == q.quorum_id
        else:
            assert q.job_step == max(self.seen_step[role], q.max_step)
        self.seen_step[role] = q.job_step
        fresh = {m.replica_id for m in q.members if m.step == q.max_step}
        lagging = {m.replica_id for m in q.members if m.step < q.max_step}
        assert set(q.heal) == lagging
        assert set(q.heal.values()) <= fresh
        assert [m.rank for m in q.members] == list(range(len(q.members)))
        assert q.replica_ids == sorted(q.replica_ids)
        self.last_formed[role] = q
        self.failed_commit[role] = False
        for m in q.members:
            member = self.state.members.get(m.replica_id)
            if member is not None:  # else evicted later in the same call
                assert member.last_round == q.round
                self.answers[(m.replica_id, str(member.last_request_id))] = q

    # -- rules -------------------------------------------------------------

    @initialize(policy=st.integers(0, 5), rollout=st.integers(0, 3))
    def populate(self, policy: int, rollout: int) -> None:
        """Start with a few replicas of each role, so that quorums form early."""
        for role, n in (("policy", policy), ("rollout", rollout)):
            self.join(role, list(NAMES[:n]))

    @rule(
        role=st.sampled_from(ROLES), names=st.lists(st.sampled_from(NAMES), min_size=1, max_size=4)
    )
    def join(self, role: str, names: list[str]) -> None:
        """Replicas register; a name already live is a restarted process (new incarnation)."""
        for name in names:
            self.incarnation += 1
            _, tick = self.state.register(
                role, name, f"i{self.incarnation}", now=self.now, wall=self.now
            )
            self.settle(tick, adds_member=True)

    @precondition(lambda self: self.state.members)
    @rule(i=st.integers(0, 99))
    def leave(self, i: int) -> None:
        self.settle(self.state.deregister(self.pick(i), "test", now=self.now, wall=self.now))

    @precondition(lambda self: self.state.members)
    @rule(i=st.integers(0, 99), step=st.none() | st.integers(0, 30), everyone=st.booleans())
    def heartbeat(self, i: int, step: int | None, everyone: bool) -> None:
        for rid in self.live() if everyone else [self.pick(i)]:
            self.state.heartbeat(rid, now=self.now, wall=self.now, step=step)
        self.settle(Tick())

    @precondition(lambda self: self.state.members)
    @rule(
        i=st.integers(0, 99),
        step=st.integers(0, 30),
        timeout=st.sampled_from([0.5, 5.0, 60.0]),
        retry=st.booleans(),
    )
    def request_quorum(self, i: int, step: int, timeout: float, retry: bool) -> None:
        self.request_quorum_as(self.pick(i), step, timeout, retry)

    def request_quorum_as(self, rid: str, step: int, timeout: float, retry: bool) -> None:
        if rid not in self.state.members:
            return  # evicted earlier in this round (an old incarnation's eviction)
        if retry and rid in self.last_request:
            req = self.last_request[rid]
        else:
            self.request_seq += 1
            req = f"r{self.request_seq}"
        self.last_request[rid] = req
        earlier = self.answers.get((rid, req))
        role = self.state.roles[self.state.members[rid].role]
        if earlier is None and role.orphaned(step, 0) is not None:
            # A state of a branch the role rolled back (this machine's replicas commit
            # in no quorum: lineage 0) is refused, changing nothing.
            with pytest.raises(Conflict) as e:
                self.state.request_quorum(rid, step, req, timeout, now=self.now, wall=self.now)
            assert e.value.field == "step" and self.state.log.changes == []
            return
        q, tick = self.state.request_quorum(rid, step, req, timeout, now=self.now, wall=self.now)
        if earlier is not None and not tick.formed:
            # An idempotent retry returns the very quorum it was given.
            assert q == earlier
        self.settle(tick)
        if q is not None:
            assert rid in q.replica_ids
            assert q == self.answers[(rid, req)]

    @rule(
        role=st.sampled_from(ROLES),
        steps=st.lists(st.integers(0, 30), min_size=1, max_size=6),
        straggler=st.none() | st.integers(0, 4),
    )
    def request_round(self, role: str, steps: list[int], straggler: int | None) -> None:
        """The live replicas of a role all ask at once (one straggler may sit out),
        as they do at every step boundary."""
        for n, rid in enumerate(self.live(role)):
            if n != straggler:
                self.request_quorum_as(rid, steps[n % len(steps)], 60.0, retry=False)

    @precondition(lambda self: self.state.members)
    @rule(
        i=st.integers(0, 99),
        suspects=st.lists(st.integers(0, 99), max_size=3),
        ghost=st.booleans(),
        failed_commit=st.booleans(),
    )
    def report_failure(self, i: int, suspects: list[int], ghost: bool, failed_commit: bool) -> None:
        reporter = self.pick(i)
        role = self.state.members[reporter].role
        named = [self.pick(j) for j in suspects]
        named = [s for s in named if s != reporter]
        if ghost:
            named.append(min(self.evicted, default="ghost:0"))
        known = set(self.state.members)
        unknown, tick = self.state.report_failure(
            reporter, named, now=self.now, wall=self.now, failed_commit=failed_commit
        )
        assert set(unknown) == {s for s in named if s not in known}
        assert set(tick.probe) <= set(named)
        # Only a suspect a majority of its peers reported is evicted at once.
        assert set(tick.evicted) <= set(named) - set(unknown)
        if failed_commit:
            self.failed_commit[role] = True
        self.settle(tick)

    @rule(
        dt=CLOCK_STEPS, beat=st.sampled_from(["none", "all", "all but one"]), i=st.integers(0, 99)
    )
    def tick(self, dt: float, beat: str, i: int) -> None:
        """Time passes (a little, or far past every timeout); replicas that keep
        running heartbeat at the new time before the controller ticks."""
        self.now += dt
        if beat != "none":
            silent = self.pick(i) if beat == "all but one" and self.state.members else None
            for rid in self.live():
                if rid != silent:
                    self.state.heartbeat(rid, now=self.now, wall=self.now)
        before = set(self.state.members)
        tick = self.state.tick(now=self.now, wall=self.now)
        assert set(tick.evicted) <= before
        self.settle(tick)

    @precondition(lambda self: self.state.members)
    @rule(i=st.integers(0, 99), to_role=st.booleans(), ack=st.integers(0, 3))
    def command(self, i: int, to_role: bool, ack: int) -> None:
        """Queue a command (for one replica or a whole role), then a replica acks
        its oldest ``ack`` pending commands plus one id that is not pending."""
        rid = self.pick(i)
        target = self.state.members[rid].role if to_role else rid
        cmds, tick = self.state.enqueue(target, "sync", {"i": i}, now=self.now, wall=self.now)
        assert {c.replica_id for c in cmds} == tick.commands_for
        assert rid in tick.commands_for
        pending = self.state.pending_commands(rid)
        assert [c.id for c in pending] == sorted(c.id for c in pending)
        ids = [c.id for c in pending[:ack]]
        assert self.state.ack(rid, [*ids, 10**9]) == [10**9]
        assert self.state.pending_commands(rid) == pending[ack:]
        self.settle(Tick())

    @rule(dt=CLOCK_STEPS)
    def restart(self, dt: float) -> None:
        old = self.state
        self.now += dt
        self.journal.close()
        self.journal = Journal(Path(self._dir.name) / "journal.sqlite")
        new = RecordingState.restore(CFG, self.journal.load(), self.now)
        new.start(self.now, self.now)
        self.journal.write(new.drain())
        assert {r: m.record() for r, m in new.members.items()} == {
            r: m.record() for r, m in old.members.items()
        }
        assert new.commands.seq == old.commands.seq
        assert {r: q for r, q in new.commands.queues.items() if q} == {
            r: q for r, q in old.commands.queues.items() if q
        }
        for name in ROLES:
            a, b = old.roles[name], new.roles[name]
            assert (a.meta(), a.last_quorum) == (b.meta(), b.last_quorum)
        assert new.epoch == old.epoch + 1
        self.state = new
        # Pending requests are not durable: clients re-ask (with a fresh request id).
        self.last_request.clear()

    # -- invariants --------------------------------------------------------

    @invariant()
    def monotonic(self) -> None:
        for name in ROLES:
            rs = self.state.roles[name]
            assert rs.quorum_id >= self.seen_quorum_id[name]
            assert rs.round >= self.seen_round[name]
            # The role's step goes back only by a rollback, which the quorum that made
            # it reported (seen_step follows it there).
            assert rs.step >= self.seen_step[name]
            last = self.last_formed[name]
            assert rs.last_quorum == last
            assert rs.round == (last.round if last else 0)
            assert rs.quorum_id == (last.quorum_id if last else 0)
            self.seen_quorum_id[name] = rs.quorum_id
            self.seen_round[name] = rs.round
            self.seen_step[name] = rs.step

    @invariant()
    def bookkeeping(self) -> None:
        assert not set(self.state.members) & self.evicted
        for name in ROLES:
            rs = self.state.roles[name]
            assert rs.member_ids == set(self.live(name))
            assert set(rs.pending) <= rs.member_ids
            assert rs.prev_pending == len(set(rs.pending) & rs.prev_ids)
            assert (rs.pending_since is None) == (not rs.pending)
            assert rs.force_bump == self.failed_commit[name]
        assert set(self.state.commands.queues) <= set(self.state.members)

    @invariant()
    def indexes_agree(self) -> None:
        """The indexes that keep a request, a heartbeat and a tick O(1) at N replicas
        say what a scan of the records would."""
        ms = self.state.members
        for name in ROLES:
            rs = self.state.roles[name]
            by_step: dict[int, set[str]] = {}
            for rid in rs.member_ids:
                by_step.setdefault(ms[rid].step, set()).add(rid)
            assert rs.by_step == by_step
            assert rs.pending_steps == Counter(p.step for p in rs.pending.values())
            assert rs.layouts == Counter((ms[r].ranks, ms[r].tp) for r in rs.member_ids)
            assert rs.roots == Counter((ms[r].state_root, ms[r].root_id) for r in rs.member_ids)
            assert all(rs.next_deadline <= p.deadline for p in rs.pending.values())
        seen = list(self.state.membership._by_seen)
        assert sorted(seen) == sorted(ms)
        assert [ms[r].last_seen for r in seen] == sorted(ms[r].last_seen for r in seen)
        assert self.state.membership._suspects == {
            r for r, m in ms.items() if m.suspect_since is not None
        }

    @invariant()
    def journal_matches(self) -> None:
        assert self.state.log.changes == []


ControllerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
test_controller_state_machine = ControllerMachine.TestCase

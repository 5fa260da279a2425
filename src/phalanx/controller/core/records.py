"""The records of the core: members, pending quorum requests, each role's state.

Quorums, commands and checkpoint records are the wire types themselves
(:mod:`phalanx.protocol`), built here from trusted values; nothing here does
I/O or reads a clock.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from dataclasses import dataclass, field, fields
from typing import Any

from phalanx.config import RoleSection
from phalanx.controller.core.base import ChangeLog
from phalanx.protocol.membership import Quorum, QuorumMember


@dataclass
class Member:
    replica_id: str
    role: str
    name: str
    ranks: int
    address: str
    capabilities: dict[str, Any]
    registered_at: float
    """Wall-clock time of registration (for people; never used in decisions)."""
    step: int = 0
    """Its newest committed step: reported, asked a quorum with, or, at registration,
    what it holds or its checkpoint root can load."""
    state_root: str = ""
    """The checkpoint root it saves to and resumes from ('' for none)."""
    root_id: str = ""
    """The id in that root's marker file (:mod:`phalanx.checkpoint.root`)."""
    tp: int = 1
    """Its tensor-parallel degree: with ``ranks``, its layout (a journal written before
    it was kept restores 1)."""
    last_request_id: str | None = None
    last_round: int | None = None
    active_at: float | None = None
    """Wall-clock time it first took part in a quorum without being healed (None while
    it joins or heals)."""
    # Liveness and figures for people: not durable, reset on restore.
    last_seen: float = field(default=0.0, compare=False)
    suspect_since: float | None = field(default=None, compare=False)
    suspect_reason: str = field(default="", compare=False)
    loss: float | None = field(default=None, compare=False)
    inner_step: int | None = field(default=None, compare=False)
    reported_by: dict[str, float] = field(default_factory=dict, compare=False)
    """Peers that reported it failing, with when (monotonic): a majority of its role
    evicts it even if it still answers the controller (a partition between it and
    its peers, which the controller's own probe cannot see)."""

    def record(self) -> dict[str, Any]:
        """The durable fields: those marked ``compare=False`` are liveness and figures.
        (Not ``dataclasses.asdict``: its deep copies made a round's N member records
        half of a quorum formation's cost at N = 10,000.)"""
        d = {name: getattr(self, name) for name in _DURABLE}
        d["capabilities"] = dict(self.capabilities)
        return d


_DURABLE = tuple(f.name for f in fields(Member) if f.compare)


def quorum_of(rec: dict[str, Any]) -> Quorum:
    """A journaled quorum record as the wire type (trusted: it was built here)."""
    members = tuple(QuorumMember.model_construct(**m) for m in rec["members"])
    fields = {k: v for k, v in rec.items() if k != "request_ids"}  # the journal's own
    shares = tuple(rec.get("shares", ()))  # (a JSON list; none in an older journal)
    return Quorum.model_construct(**{**fields, "members": members, "shares": shares})


@dataclass
class Pending:
    step: int
    request_id: str
    deadline: float
    lineage: int = 0


@dataclass
class RoleState:
    name: str
    cfg: RoleSection
    quorum_id: int = 0
    round: int = 0
    step: int = 0
    force_bump: bool = False
    quorums: list[Quorum] = field(default_factory=list)
    pending: dict[str, Pending] = field(default_factory=dict)
    pending_since: float | None = None
    member_ids: set[str] = field(default_factory=set)
    by_step: dict[int, set[str]] = field(default_factory=dict)
    """The live members by their step (:attr:`Member.step`), kept by :meth:`join`,
    :meth:`leave` and :meth:`restep`: whether a member that has not asked holds a
    newer step is then O(distinct steps) a request, not O(N)."""
    pending_steps: Counter[int] = field(default_factory=Counter)
    """How many pending requests ask at each step (the round's newest step in O(1))."""
    next_deadline: float = math.inf
    """No pending request expires before this (the ticker skips the scan until then)."""
    layouts: Counter[tuple[int, int]] = field(default_factory=Counter)
    """How many live members have each layout, (ranks, tp)."""
    roots: Counter[tuple[str, str]] = field(default_factory=Counter)
    """How many live members name each (state root, root id)."""
    prev_ids: frozenset[str] = frozenset()
    prev_pending: int = 0
    """How many of the previous quorum's members are pending (kept incrementally,
    so that each quorum request is O(1) and a round of N requests is O(N))."""
    prev_since: float | None = None
    """When the first of the previous quorum's members asked again: the start of the
    round."""
    quorate_since: float | None = None
    """When this round's requests first sufficed for a quorum (enough of them, and a
    majority of the live members): stragglers are timed (``join_timeout_s``) from
    the later of this and :attr:`prev_since` (not durable: nor are requests)."""
    failures: list[dict[str, Any]] = field(default_factory=list)
    """Evictions not yet followed by a quorum: the next quorum reports, for each,
    the time from the failure to it (not durable)."""
    rollbacks: list[dict[str, Any]] = field(default_factory=list)
    """Explicit rollbacks of the role's step, oldest first (durable, the last
    :data:`ROLLBACKS_KEPT`): ``quorum_id``, ``from_step``, ``to_step``, ``at``."""
    unproven_step: int = 0
    """The newest step held by a member evicted without proof that its process is
    gone (a heartbeat timeout: stopped, cut off), since the role's last quorum; it
    may come back with it. Durable."""
    lost_since: float | None = None
    """Since when a quorum could have formed but only behind the role's step (monotonic;
    not durable: a restarted controller waits afresh). It waits
    ``timeouts.lost_step_wait_s`` from here for a replica that holds the step."""
    steps_seen: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=64))
    """(monotonic time, step) whenever the role's step grew: the steps-per-second rate."""
    losses: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=500))
    """(step, loss) as the replicas report them with their heartbeats (not durable)."""

    @property
    def last_quorum(self) -> Quorum | None:
        return self.quorums[-1] if self.quorums else None

    # -- live members, indexed (every change goes through these) -------------

    def join(self, m: Member) -> None:
        self.member_ids.add(m.replica_id)
        self.by_step.setdefault(m.step, set()).add(m.replica_id)
        self.layouts[(m.ranks, m.tp)] += 1
        self.roots[(m.state_root, m.root_id)] += 1

    def leave(self, m: Member) -> None:
        self.member_ids.discard(m.replica_id)
        self._unstep(m)
        _uncount(self.layouts, (m.ranks, m.tp))
        _uncount(self.roots, (m.state_root, m.root_id))

    def restep(self, m: Member, step: int) -> None:
        """Set a live member's step."""
        if step != m.step:
            self._unstep(m)
            m.step = step
            self.by_step.setdefault(step, set()).add(m.replica_id)

    def _unstep(self, m: Member) -> None:
        ids = self.by_step.get(m.step)
        if ids is not None:
            ids.discard(m.replica_id)
            if not ids:
                del self.by_step[m.step]

    # -- pending requests ---------------------------------------------------

    def newest_pending(self) -> int:
        """The newest step a pending request asks at (call with requests pending)."""
        return max(self.pending_steps)

    def add_pending(self, replica_id: str, p: Pending, now: float) -> None:
        old = self.pending.get(replica_id)
        if old is not None:
            _uncount(self.pending_steps, old.step)
        elif replica_id in self.prev_ids:
            self.prev_pending += 1
            if self.prev_since is None:
                self.prev_since = now
        self.pending[replica_id] = p
        self.pending_steps[p.step] += 1
        self.next_deadline = min(self.next_deadline, p.deadline)
        if self.pending_since is None:
            self.pending_since = now

    def drop_pending(self, replica_id: str) -> None:
        p = self.pending.pop(replica_id, None)
        if p is not None:
            _uncount(self.pending_steps, p.step)
            if replica_id in self.prev_ids:
                self.prev_pending -= 1
                if self.prev_pending == 0:
                    self.prev_since = None
        if not self.pending:
            self.pending_since = None
            self.quorate_since = None

    def set_formed(self, q: Quorum) -> None:
        self.quorums.append(q)
        self.unproven_step = 0  # its evictees' steps are the quorum's, or rolled back
        self.prev_ids = frozenset(q.replica_ids)
        self.pending.clear()
        self.pending_steps.clear()
        self.next_deadline = math.inf
        self.pending_since = None
        self.prev_pending = 0
        self.prev_since = None
        self.quorate_since = None

    def meta(self) -> dict[str, Any]:
        return {
            "quorum_id": self.quorum_id,
            "round": self.round,
            "step": self.step,
            "force_bump": self.force_bump,
            "rollbacks": self.rollbacks,
            "unproven_step": self.unproven_step,
        }

    def orphaned(self, step: int, lineage: int) -> dict[str, Any] | None:
        """The rollback that abandoned a state at ``step`` committed last in quorum
        ``lineage``, if one did: one after that quorum, to a step below ``step``. Such a
        state holds steps the job no longer has (the ledger took their batches back);
        it must never be healed from, nor trained on."""
        for rb in reversed(self.rollbacks):
            if rb["quorum_id"] > lineage and step > rb["to_step"]:
                return rb
        return None

    def bump_step(self, step: int, now: float) -> bool:
        """Raise the role's step (the saver of a checkpoint, a heartbeat); True if it grew."""
        if step > self.step:
            self.step = step
            self.steps_seen.append((now, step))
            return True
        return False


def _uncount(c: Counter[Any], key: Any) -> None:
    c[key] -= 1
    if c[key] <= 0:
        del c[key]


ROLLBACKS_KEPT = 64
"""Rollbacks remembered per role (each one decides, for the rest of the job, which
states are of an abandoned branch: :meth:`RoleState.orphaned`)."""


def save_role(log: ChangeLog, rs: RoleState) -> None:
    log.put("meta", f"role/{rs.name}", rs.meta())

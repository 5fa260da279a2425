"""Membership: who is in the job, who is alive, and who is suspected.

A replica registers (a fresh incarnation of its stable name), heartbeats,
and leaves or is evicted. Failure detection has three sources (DESIGN.md,
Failure): a peer's report and a dropped held connection make a member
*suspect*, evicted only if it does not heartbeat within ``suspect_grace_s``;
a heartbeat silence past ``heartbeat_s`` evicts it outright. What an eviction
sets off elsewhere (quorums, the ledger, command queues) is the state's to
orchestrate (:mod:`phalanx.controller.core.state`); this class keeps the
member records.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any

from phalanx.config import JobConfig
from phalanx.controller.core.base import ChangeLog, Conflict, StateError, UnknownReplica
from phalanx.controller.core.overview import detector_of
from phalanx.controller.core.records import Member, RoleState, save_role
from phalanx.protocol.quorum import layout_of


class Membership:
    def __init__(self, cfg: JobConfig, log: ChangeLog, roles: dict[str, RoleState]):
        self.cfg, self.log, self.roles = cfg, log, roles
        self.members: dict[str, Member] = {}
        self._by_name: dict[tuple[str, str], str] = {}
        self._cut_off: dict[tuple[str, str], float] = {}
        """(role, name) -> when peers evicted it as unreachable (not durable)."""
        self.cut_off: set[str] = set()
        """New incarnations of those: until one asks for a quorum (once it reaches its
        peers again), rounds do not wait for it (not durable)."""
        self._by_seen: OrderedDict[str, None] = OrderedDict()
        """Member ids, least recently seen first (:meth:`touch`): the ticker finds the
        silent ones at the front instead of scanning every member every tick."""
        self._seen_in_order = True
        """False once a clock went back: :meth:`overdue` then scans them all."""
        self._last_touch = -math.inf
        self._suspects: set[str] = set()

    def restore(self, tables: dict[str, dict[str, dict[str, Any]]], now: float) -> None:
        for rec in tables.get("members", {}).values():
            if rec["role"] not in self.roles:
                continue  # role removed from the config: the member cannot take part
            self._add(Member(**rec, last_seen=now))

    def _add(self, m: Member) -> None:
        self.members[m.replica_id] = m
        self._by_name[(m.role, m.name)] = m.replica_id
        self.roles[m.role].join(m)
        self._by_seen[m.replica_id] = None
        self._note_touch(m.last_seen)

    # -- lookups ---------------------------------------------------------

    def role(self, role: str) -> RoleState:
        try:
            return self.roles[role]
        except KeyError:
            raise StateError(
                f"role must be one of the job's roles {sorted(self.roles)}: got {role!r}. "
                f"Add a [roles.{role}] section to the job config or register with another role.",
                field="role",
            ) from None

    def member(self, replica_id: str, field: str = "replica_id") -> Member:
        m = self.members.get(replica_id)
        if m is None:
            raise UnknownReplica(
                f"replica {replica_id!r} is not a member of this job (never registered, or "
                f"evicted). Register again to get a new incarnation.",
                field=field,
            )
        return m

    def alive(self, role: str) -> list[Member]:
        return [self.members[rid] for rid in sorted(self.roles[role].member_ids)]

    def seen(self, replica_id: str, now: float) -> Member:
        """The member, marked alive now (any request of its own is a sign of life)."""
        m = self.member(replica_id)
        self.touch(m, now)
        return m

    def touch(self, m: Member, now: float) -> None:
        """Mark a live member seen at ``now``: the one way to set ``last_seen``, which
        keeps :meth:`overdue` O(evicted) a tick. O(1)."""
        m.last_seen = now
        self._by_seen.move_to_end(m.replica_id)
        self._note_touch(now)

    def _note_touch(self, now: float) -> None:
        if now < self._last_touch:
            self._seen_in_order = False
        else:
            self._last_touch = now

    # -- changes ---------------------------------------------------------

    def add(
        self,
        role: str,
        name: str,
        incarnation: str,
        *,
        now: float,
        wall: float,
        ranks: int,
        address: str,
        capabilities: dict[str, Any],
        step: int = 0,
        state_root: str = "",
        root_id: str = "",
        tp: int = 1,
    ) -> tuple[Member, str | None]:
        """Add a replica; returns it and the live older incarnation of the same role
        and name, which the caller must evict. ``step``: what it holds or its root can
        load; ``state_root``/``root_id``: the checkpoint root it saves to, which must be
        its live peers' (:meth:`_check_root`)."""
        rs = self.role(role)
        rid = f"{name}:{incarnation}"
        # Checked before anything changes: a reused id must be refused without side
        # effects, not evict the live member and revive its id.
        if rid in self.members:
            raise Conflict(f"replica id {rid!r} is already registered; use a fresh incarnation.")
        old = self._by_name.get((role, name))
        old_m = self.members[old] if old is not None else None
        mine = (ranks, tp)
        other = sorted(
            k
            for k, n in rs.layouts.items()
            if k != mine and n > (old_m is not None and (old_m.ranks, old_m.tp) == k)
        )
        if other:
            # Shard r of a replica all-reduces with shard r of its peers: replicas of
            # another layout (size, or TP degree) cannot share a step. The job changes
            # its layout through a checkpoint: drain the live replicas (the last saves
            # its step), then start the new ones, which load it resharded.
            r, t = other[0]
            raise Conflict(
                f"this replica spans {layout_of(ranks, tp)} but role {role!r}'s live "
                f"replicas span {layout_of(r, t)}: start it with [replica] ranks = {r}, "
                f"tp = {t}, or drain them first (with checkpoint.url set, the new layout "
                "resumes from their last checkpoint, resharded)",
                field="tp" if r == ranks else "ranks",
            )
        self._check_root(rs, name, old, state_root, root_id)
        m = Member(rid, rs.name, name, ranks, address, dict(capabilities), wall, step=step, tp=tp)
        m.state_root, m.root_id = state_root, root_id
        m.last_seen = now
        cut = self._cut_off.pop((role, name), None)
        if cut is not None and now - cut < self.cfg.timeouts.quorum_s:
            self.cut_off.add(rid)
        return m, old

    def _check_root(
        self, rs: RoleState, name: str, old: str | None, root: str, root_id: str
    ) -> None:
        """Refuse a replica whose checkpoint root is not its live peers' (the old
        incarnation of the same name aside). One root per role is what makes "durable"
        mean something: the ledger drops a batch once a save holding it commits, and
        only a root every later restart reads keeps that save. Replicas with roots of
        their own (local disks of two hosts) each resume from their own, older save
        when the other's is newer: the job silently went back, and the ledger counted
        both branches as trained (issue 34). A root shared at last restart is not
        pinned: with no live peer, a replica may bring another (the job then waits for,
        or explicitly rolls back to, what that root holds)."""
        same = rs.roots.get((root, root_id), 0)
        if old is not None and (self.members[old].state_root, self.members[old].root_id) == (
            root,
            root_id,
        ):
            same -= 1
        if same == len(rs.member_ids) - (old is not None):
            return  # every live peer names this root (counted: O(1) a registration)
        for rid in sorted(rs.member_ids):
            peer = self.members[rid]
            if rid == old or (peer.state_root, peer.root_id) == (root, root_id):
                continue
            if peer.state_root != root:
                got = f"{root or 'none'} on {name} and {peer.state_root or 'none'} on {peer.name}"
                why = ""
            else:
                got = f"{root} on {name} is not the root {peer.name} writes"
                why = " (its marker file holds another id: the same path on another host's disk?)"
            raise Conflict(
                f"{rs.name} replicas must share one state root: got {got}{why}. Start "
                f"every {rs.name} replica with the same root, on storage they all reach "
                "(a shared filesystem or a storage URL), so that any restart resumes from "
                "the newest save.",
                field="state_root",
            )

    def admit(self, m: Member, wall: float) -> None:
        """Record a member made by :meth:`add` (after its old incarnation left)."""
        self._add(m)
        self.log.put("members", m.replica_id, m.record())
        self.log.event("join", wall, role=m.role, replica_id=m.replica_id)

    def evict(self, replica_id: str, reason: str, now: float, wall: float) -> Member:
        """Remove a member for ``reason``: the ``evict`` event, and, unless it left or an
        operator evicted it, a failure record that the role's next quorum reports the
        recovery time of. Returns the removed member."""
        m = self.remove(replica_id)
        # When it failed, as the controller can tell: suspected, else last seen, else now.
        detector = detector_of(reason)
        rs = self.roles[m.role]
        if m.step > rs.unproven_step and not _gone(reason, detector):
            # It may still hold its state (stopped, cut off): a round behind the
            # role's step waits for it to come back (Quorums._waits_for_step).
            rs.unproven_step = m.step
            save_role(self.log, rs)
        since = m.suspect_since if m.suspect_since is not None else m.last_seen
        failed_at = wall - (now - since) if detector not in ("agent", "operator") else wall
        if detector not in ("left", "operator"):
            rs.failures.append(
                {"replica_id": replica_id, "detector": detector, "failed_at": failed_at}
            )
        self.log.event(
            "evict",
            wall,
            role=m.role,
            replica_id=replica_id,
            reason=reason,
            detector=detector,
            failed_at=round(failed_at, 3),
            uptime_s=round(wall - m.registered_at, 3),
        )
        return m

    def save(self, m: Member) -> None:
        self.log.put("members", m.replica_id, m.record())

    def remove(self, replica_id: str) -> Member:
        self.cut_off.discard(replica_id)
        self._suspects.discard(replica_id)
        self._explained_by(self.members[replica_id])
        m = self.members.pop(replica_id)
        del self._by_name[(m.role, m.name)]
        del self._by_seen[replica_id]
        self.roles[m.role].leave(m)
        self.log.put("members", replica_id, None)
        return m

    def heartbeat(
        self,
        replica_id: str,
        *,
        now: float,
        wall: float,
        step: int | None,
        loss: float | None,
        inner_step: int | None,
        healed: dict[str, Any] | None,
    ) -> Member:
        m = self.seen(replica_id, now)
        m.suspect_since = None
        self._suspects.discard(replica_id)
        if healed is not None:
            self.log.event("healed", wall, role=m.role, replica_id=replica_id, **healed)
        if inner_step is not None:
            m.inner_step = inner_step
        rs = self.roles[m.role]
        if loss is not None and step is not None:
            m.loss = loss
            if not rs.losses or step > rs.losses[-1][0]:
                rs.losses.append((step, loss))
        if step is not None and step > m.step:
            rs.restep(m, step)
            self.save(m)
            if rs.bump_step(step, now):
                save_role(self.log, rs)
        return m

    def reported(self, replica_id: str, reporter: str, now: float) -> str | None:
        """Record that ``reporter`` saw ``replica_id`` fail. Returns the reason to
        evict it at once when a strict majority of its role's other live members
        (two at least) reported it within ``heartbeat_s``, even if it still answers
        the controller: its peers cannot reach it, a partition the controller's
        own probe does not cross. A replica on the minority side of a partition
        reports the others too (replicas report the peers they cannot reach:
        ``Manager._report_peers``), but never reaches a majority against any. A
        suspect holding a newer step than every reporter is never evicted this way:
        that would lose committed steps (the probe still evicts it if it is dead).
        Two replicas cut from each other report each other: the controller cannot
        tell which side is at fault, and evicts the first to report, so that the
        other goes on (a dead or stuck replica reports nobody: the probe finds it)."""
        m = self.members[replica_id]
        window = self.cfg.timeouts.heartbeat_s
        m.reported_by = {r: t for r, t in m.reported_by.items() if now - t < window}
        m.reported_by[reporter] = now
        others = self.roles[m.role].member_ids - {replica_id}
        by = len(others & set(m.reported_by))
        if m.step > max(
            (self.members[r].step for r in m.reported_by if r in self.members), default=-1
        ):
            return None  # it holds a newer step than its reporters: the probe decides
        if len(others) >= 2 and 2 * by > len(others):
            self._cut_off[(m.role, m.name)] = now
            return f"failure report by {by} of its {len(others)} peers (unreachable by them)"
        mutual = replica_id in self.members[reporter].reported_by
        if len(others) == 1 and mutual:
            self._cut_off[(m.role, m.name)] = now
            return "failure report by its only peer, which it reported too (cut from each other)"
        return None

    def _explained_by(self, m: Member) -> None:
        """``m`` is gone (evicted on reports, by the probe or the heartbeat timeout):
        its reporters failed in a collective with it, and what they reported of each
        other in that window is explained by ``m`` and no longer counts. A collective
        fails on every member when one hangs, and a replica that reaches every peer
        (a stopped process's port still accepts) reports them all: left to count, two
        survivors' reports of each other would evict one of them as cut off."""
        blamed = set(m.reported_by)
        if not blamed:
            return  # most evictions: nobody reported it, so no report is explained
        for rid in self.roles[m.role].member_ids - {m.replica_id}:
            other = self.members[rid]
            other.reported_by = {r: t for r, t in other.reported_by.items() if r not in blamed}

    def suspect(self, replica_id: str, reason: str, now: float) -> bool:
        """Start the grace of a live, unsuspected member; False if unknown or already."""
        m = self.members.get(replica_id)
        if m is None or m.suspect_since is not None:
            return False
        m.suspect_since, m.suspect_reason = now, reason
        self._suspects.add(replica_id)
        return True

    def overdue(self, now: float) -> list[tuple[str, str]]:
        """(replica id, reason) of every member to evict now: suspects past their
        grace, and members silent past the heartbeat timeout, in registration order.
        Called every tick: O(suspects + evicted), not O(members)."""
        t = self.cfg.timeouts
        out: dict[str, str] = {}
        for rid in self._suspects:
            m = self.members[rid]
            if m.suspect_since is not None and now - m.suspect_since >= t.suspect_grace_s:
                out[rid] = f"{m.suspect_reason}, no heartbeat in grace"
        for rid in self._by_seen:
            if now - self.members[rid].last_seen < t.heartbeat_s:
                if self._seen_in_order:
                    break  # the rest were seen later still
                continue
            out.setdefault(rid, "heartbeat timeout")
        if not self._seen_in_order:  # a clock went back: put them in order again
            ids = sorted(self._by_seen, key=lambda r: self.members[r].last_seen)
            self._by_seen = OrderedDict.fromkeys(ids)
            self._last_touch = self.members[ids[-1]].last_seen if ids else -math.inf
            self._seen_in_order = True
        if len(out) > 1:  # rare: order them as the members were registered
            order = {rid: i for i, rid in enumerate(self.members)}
            return sorted(out.items(), key=lambda kv: order[kv[0]])
        return list(out.items())


def _gone(reason: str, detector: str) -> bool:
    """Whether an eviction proves the process, and the state in its memory, gone: its
    address refused the controller's connection, its agent saw it exit, it left, or
    a new process of the same name replaced it (a replica that re-registered after
    an eviction registers with the step it holds). A heartbeat timeout, a failure
    report's grace or an operator's eviction proves nothing: it may be stopped, or
    cut off, and come back with its state."""
    return "address refused" in reason or detector in ("agent", "replaced", "left")

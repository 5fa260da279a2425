"""Quorum formation: who takes part in a role's next step, and who heals whom.

Replicas ask with their committed step; a quorum forms once enough of the
role's live members have asked (:meth:`Quorums.ready`), and every asker gets
the same answer. ``quorum_id`` changes iff the membership changed or a commit
failed, so that the participants know when to rebuild their process group;
replicas behind the quorum's ``max_step`` are each assigned an up-to-date peer
to heal from (DESIGN.md, Main flows).

**The role's step never goes back by accident.** A round whose newest step is
behind the role's committed step (every replica that held it is gone, or
restarting) waits up to ``timeouts.lost_step_wait_s`` for a replica that holds
it, a restarting one whose checkpoint root can load it included (it says so
when it registers). Only then does it form, as an explicit *rollback*: a new
``quorum_id``, a ``rollback`` event, and the hook that makes the RL ledger
follow. A state committed before that quorum past the step rolled back to is of
the abandoned branch (:meth:`RoleState.orphaned`): a replica that asks with
one is refused, so that it restarts from the checkpoint root or heals.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from phalanx.controller.core.base import ChangeLog, Conflict
from phalanx.controller.core.membership import Membership
from phalanx.controller.core.records import (
    ROLLBACKS_KEPT,
    Member,
    Pending,
    RoleState,
    quorum_of,
    save_role,
)
from phalanx.controller.core.steps import StepRules
from phalanx.protocol.membership import Quorum, QuorumMember

QUORUM_HISTORY = 8
"""Formed quorums kept per role, so that a retried request finds its answer."""


def _equal(ids: list[str]) -> tuple[int, ...]:
    return ()


class Quorums:
    def __init__(
        self,
        log: ChangeLog,
        roles: dict[str, RoleState],
        members: Membership,
        rules: StepRules | None = None,
    ):
        self.log, self.roles, self.members = log, roles, members
        self.rules = rules or StepRules()
        self.shares: Callable[[list[str]], tuple[int, ...]] = _equal
        """The share weights of a quorum of these members, in rank order (empty: the
        equal split): the straggler watch's (:mod:`.stragglers`)."""

    def restore(self, tables: dict[str, dict[str, dict[str, Any]]]) -> None:
        for key in sorted(tables.get("quorums", {})):
            q = quorum_of(tables["quorums"][key])
            if q.role in self.roles:
                self.roles[q.role].set_formed(q)
        meta = tables.get("meta", {})
        for name, role in self.roles.items():
            m = meta.get(f"role/{name}")
            if m:  # after the quorums: set_formed resets what the meta says
                role.quorum_id, role.round = m["quorum_id"], m["round"]
                role.step, role.force_bump = m["step"], m["force_bump"]
                role.rollbacks = list(m.get("rollbacks", []))
                role.unproven_step = int(m.get("unproven_step", 0))

    def recall(self, tables: dict[str, dict[str, dict[str, Any]]]) -> None:
        """At a restore, after the members: give each member the step, request id and
        round of the newest journaled quorum it took part in, unless its own record
        is newer (written after that quorum formed). A journal of an older controller,
        which wrote them into the member records, holds no ``request_ids``."""
        ms = self.members.members
        for key in sorted(tables.get("quorums", {})):
            rec = tables["quorums"][key]
            ids = rec.get("request_ids")
            if rec["role"] not in self.roles or not isinstance(ids, list):
                continue
            rs = self.roles[rec["role"]]
            for qm, request_id in zip(rec["members"], ids, strict=False):
                m = ms.get(qm["replica_id"])
                if m is not None and (m.last_round is None or rec["round"] > m.last_round):
                    m.last_request_id, m.last_round = request_id, rec["round"]
                    rs.restep(m, qm["step"])

    def request(
        self,
        m: Member,
        step: int,
        request_id: str,
        timeout_s: float,
        *,
        now: float,
        wall: float,
        lineage: int = 0,
    ) -> tuple[Quorum | None, Quorum | None]:
        """Ask for ``m`` to take part in its role's next quorum, at ``step`` (its
        committed step). Returns (its quorum if formed now or for the same
        ``request_id`` earlier, a quorum formed by this request)."""
        done = self.answer(m.replica_id, request_id)
        if done is not None:
            return done, None
        rs = self.roles[m.role]
        rb = rs.orphaned(step, lineage) if self.rules.guarded(rs) else None
        if rb is not None:
            raise Conflict(
                f"this replica's state must be of the job's lineage: it holds step {step}, "
                f"committed in quorum {lineage}, but quorum {rb['quorum_id']} rolled the job "
                f"back from step {rb['from_step']} to {rb['to_step']}, and the steps after it "
                "were trained again. Restart the replica: it resumes from the checkpoint "
                "root, or heals from a peer.",
                field="step",
            )
        req = Pending(step, request_id, now + timeout_s, lineage)
        self.members.cut_off.discard(m.replica_id)
        rs.add_pending(m.replica_id, req, now)
        formed = self.try_form(rs, now, wall)
        return self.answer(m.replica_id, request_id), formed

    def answer(self, replica_id: str, request_id: str) -> Quorum | None:
        m = self.members.members.get(replica_id)
        if m is None or m.last_request_id != request_id or m.last_round is None:
            return None
        for q in reversed(self.roles[m.role].quorums):
            if q.round == m.last_round:
                return q
        return None

    def expire_requests(self, now: float) -> None:
        """Drop requests whose asker gave up waiting (past their ``timeout_s``). Called
        every tick: a role's requests are scanned only once the earliest may expire."""
        for rs in self.roles.values():
            if now < rs.next_deadline:
                continue
            for rid in [rid for rid, p in rs.pending.items() if p.deadline <= now]:
                rs.drop_pending(rid)
            rs.next_deadline = min((p.deadline for p in rs.pending.values()), default=math.inf)

    def force_bump(self, role: str) -> None:
        """A commit failed: the role's next quorum gets a new id, whatever its members."""
        rs = self.roles[role]
        if not rs.force_bump:
            rs.force_bump = True
            save_role(self.log, rs)

    def ready(self, rs: RoleState, now: float) -> bool:
        pend = len(rs.pending)
        if pend == 0:
            return False
        # A replica its peers cannot reach is not waited for until it asks.
        cut = self.members.cut_off
        n_alive = len(rs.member_ids) - (len(cut & rs.member_ids - rs.pending.keys()) if cut else 0)
        first = rs.last_quorum is None
        need = rs.cfg.n_init_replicas if first else rs.cfg.min_replicas
        if pend < need or 2 * pend <= n_alive:
            rs.quorate_since = None
            return False  # too few, or not a majority of the heartbeating replicas
        if rs.quorate_since is None:
            rs.quorate_since = now
        quorate_since = rs.quorate_since
        if self._waits_for_step(rs, now):
            return False
        if pend == n_alive:
            return True  # everyone who is alive has asked
        if self._newer_elsewhere(rs, now):
            return False  # a live member holds a newer step: without it, steps go back
        last = rs.last_quorum
        if last is not None and rs.prev_pending == len(rs.prev_ids):
            return True  # fast path: the previous quorum rejoined in full
        # Stragglers are timed from the round's start: the first of the previous
        # quorum to ask again. Replicas that asked before it (a joiner, or one left
        # out of the last round) must not start the clock, or the next quorum forms
        # at the first finisher's request and leaves the others out; the one left
        # out asks early in turn, and every later round forms short and heals.
        # Nor does the clock run out before a quorum could form: the replicas that
        # make the majority get join_timeout_s for the rest. Under packet loss the
        # first finisher of an all-reduce may ask seconds before the others, which
        # finish it together; timed from its request, the round would form at the
        # next one's and leave the last, milliseconds behind, out (then two new
        # process groups and a heal: issue 18).
        since = rs.prev_since
        if since is None:
            if last is not None and any(rid in rs.member_ids for rid in rs.prev_ids):
                return False  # the previous quorum's live members are still in their step
            since = rs.pending_since
        if since is None:  # unreachable: a pending request set pending_since
            return False
        waited = now - max(since, quorate_since)
        if waited < rs.cfg.join_timeout_s:
            return False
        t = self.members.cfg.timeouts
        return waited >= rs.cfg.join_timeout_s + max(
            t.collective_s, t.collective_patience_s
        ) or not self._finishing(rs, now)

    def _finishing(self, rs: RoleState, now: float) -> bool:
        """Whether a member of the previous quorum that has not asked yet was heard
        from within two heartbeat intervals: alive, and reaching the controller, so
        still in its step (most often in the all-reduce that the askers finished
        first: under packet loss, seconds apart). Past ``join_timeout_s`` it is
        still waited for, as long as its collective may last; one silent that long
        (cut off from the controller, stopped) is not, and the heartbeat timeout
        evicts it."""
        fresh = 2 * self.members.cfg.timeouts.heartbeat_interval_s
        ms = self.members.members
        return any(
            now - ms[rid].last_seen <= fresh and ms[rid].suspect_since is None
            for rid in rs.prev_ids
            if rid in rs.member_ids and rid not in rs.pending and rid not in self.members.cut_off
        )

    def done(self, rs: RoleState) -> bool:
        """Whether the role reached the job's last step: a replica behind it is
        answered at once (it stops), never made to wait, never rolled back to."""
        final = self.rules.final_step(rs)
        return final is not None and rs.step >= final

    def behind(self, rs: RoleState) -> bool:
        """Whether this round's newest step is behind the role's committed step, in a
        job that is not done: forming it would take the job's step back."""
        if not rs.pending or not self.rules.guarded(rs) or self.done(rs):
            return False
        return rs.newest_pending() < rs.step

    def _waits_for_step(self, rs: RoleState, now: float) -> bool:
        """Whether the round waits for a replica that holds the role's step: every
        replica that held it may be gone for good, or restarting (a process whose
        checkpoint root holds it says so when it registers, and is waited for as long
        as it is a member: :meth:`_newer_elsewhere`). Up to
        ``timeouts.lost_step_wait_s`` from when the round could first have formed;
        after that the round forms, and the job rolls back explicitly.

        Not at all when nothing can bring the step back: every replica that held it
        is proven gone (its address refused, its agent saw it exit) and no member
        holds it. A restart can only read the root its live peers read (one root
        per role), whose newest save the members that registered already named.
        A chaos-killed lone replica's unsaved steps are rolled back at once."""
        if not self.behind(rs):
            rs.lost_since = None
            return False
        if self._newer_elsewhere(rs, now):
            return True
        if rs.unproven_step < rs.step:
            return False
        if rs.lost_since is None:
            rs.lost_since = now
        return now - rs.lost_since < self.rules.wait_s

    def _newer_elsewhere(self, rs: RoleState, now: float) -> bool:
        """Whether a live member that has not asked holds a
        newer committed step than every request: a quorum without it would go on
        from an older step, and its committed steps would be done again by others.
        It is waited for; if it is dead, its eviction ends the wait. O(distinct steps)
        a call, from the role's index of its members by step."""
        newest = rs.newest_pending()
        return any(
            any(r not in rs.pending for r in ids) for s, ids in rs.by_step.items() if s > newest
        )

    def try_form(self, rs: RoleState, now: float, wall: float) -> Quorum | None:
        if not self.ready(rs, now):
            return None
        ids = sorted(rs.pending)
        last = rs.last_quorum
        rolled_from = rs.step if self.behind(rs) else None
        steps = {rid: rs.pending[rid].step for rid in ids}
        max_step = max(steps.values())
        if (
            last is None
            or rs.force_bump
            or rolled_from is not None
            or ids != sorted(last.replica_ids)
        ):
            rs.quorum_id += 1
        rs.force_bump = False
        rs.round += 1
        figures = self._roll_back(rs, max_step, wall) if rolled_from is not None else {}
        # At the newest step, the newest lineage is up to date: a replica that
        # committed that step in a quorum the others did not follow is healed.
        newest = max(rs.pending[rid].lineage for rid in ids if steps[rid] == max_step)
        fresh = [rid for rid in ids if (steps[rid], rs.pending[rid].lineage) == (max_step, newest)]
        up_to_date = set(fresh)
        lagging = [rid for rid in ids if rid not in up_to_date]
        heal = {rid: fresh[i % len(fresh)] for i, rid in enumerate(lagging)}
        members = self.members.members
        q = Quorum.model_construct(
            role=rs.name,
            quorum_id=rs.quorum_id,
            round=rs.round,
            members=tuple(
                QuorumMember.model_construct(
                    replica_id=rid,
                    name=members[rid].name,
                    address=members[rid].address,
                    ranks=members[rid].ranks,
                    tp=members[rid].tp,
                    step=steps[rid],
                    rank=rank,
                    lineage=rs.pending[rid].lineage,
                )
                for rank, rid in enumerate(ids)
            ),
            max_step=max_step,
            heal=heal,
            formed_at=wall,
            job_step=max(rs.step, max_step),
            final_step=self.rules.final_step(rs),
            rolled_back_from=rolled_from,
            shares=self.shares(ids),
        )
        ready = []
        request_ids = [rs.pending[rid].request_id for rid in ids]
        for rid, request_id in zip(ids, request_ids, strict=True):
            m = members[rid]
            m.last_request_id, m.last_round = request_id, q.round
            rs.restep(m, steps[rid])  # what it asked with is what it holds (a load may fall back)
            if m.active_at is None and rid not in heal:
                m.active_at = wall
                ready.append(m)
                self.members.save(m)
        rs.set_formed(q)
        # The members' new step, request id and round are journaled with the quorum,
        # not as N member records a round (a third of a round's cost at N = 10,000):
        # :meth:`recall` puts them back on the members at a restore. A member record
        # written later carries them too (``Member.record``), and wins.
        rec = q.model_dump()
        rec["request_ids"] = request_ids
        self.log.put("quorums", f"{rs.name}/{q.round:012d}", rec)
        if len(rs.quorums) > QUORUM_HISTORY:
            old = rs.quorums.pop(0)
            self.log.put("quorums", f"{rs.name}/{old.round:012d}", None)
        if max_step > rs.step:
            rs.steps_seen.append((now, max_step))
        rs.step = max(rs.step, max_step)
        save_role(self.log, rs)
        if rolled_from is not None:
            self.log.event(
                "rollback",
                wall,
                role=rs.name,
                from_step=rolled_from,
                to_step=max_step,
                quorum_id=q.quorum_id,
                waited_s=round(now - rs.lost_since, 3) if rs.lost_since is not None else 0.0,
                **figures,
            )
        rs.lost_since = None
        self._formed_events(rs, q, len(ids), wall, ready)
        return q

    def _roll_back(self, rs: RoleState, to_step: int, wall: float) -> dict[str, Any]:
        """Take the role's step back to ``to_step``, on the record: no live replica and
        no checkpoint holds it any more (the round waited for one). Every state
        committed before this quorum past ``to_step`` is of the abandoned branch from
        now on. Returns the figures of what the ledger took back."""
        from_step = rs.step
        rs.step = to_step
        rs.steps_seen.clear()
        figures = self.rules.rollback(rs, from_step, to_step, wall)
        rs.rollbacks.append(
            {
                "quorum_id": rs.quorum_id,
                "from_step": from_step,
                "to_step": to_step,
                "at": wall,
                **figures,
            }
        )
        del rs.rollbacks[:-ROLLBACKS_KEPT]
        return figures

    def _formed_events(
        self, rs: RoleState, q: Quorum, size: int, wall: float, ready: list[Member]
    ) -> None:
        recovered = [
            {
                "replica_id": f["replica_id"],
                "detector": f["detector"],
                "seconds": round(wall - f["failed_at"], 3),
            }
            for f in rs.failures
        ]
        rs.failures.clear()
        self.log.event(
            "quorum",
            wall,
            role=rs.name,
            quorum_id=q.quorum_id,
            round=q.round,
            size=size,
            max_step=q.max_step,
            healing=len(q.heal),
            **({"heal": dict(q.heal)} if q.heal else {}),
            **({"recovered": recovered} if recovered else {}),
        )
        for m in ready:
            self.log.event(
                "active",
                wall,
                role=rs.name,
                replica_id=m.replica_id,
                join_s=round(wall - m.registered_at, 3),
            )

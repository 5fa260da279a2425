"""Quorum formation: who takes part in a role's next step, and who heals whom.

A mixin of :class:`~phalanx.controller.state.ControllerState` (see DESIGN.md,
Main flows). Replicas ask with their committed step; a quorum forms once
enough of the role's live members have asked (:meth:`QuorumRequests._ready`),
and every asker gets the same answer. ``quorum_id`` changes iff the
membership changed or a commit failed, so that the participants know when to
rebuild their process group; replicas behind the quorum's ``max_step`` are
each assigned an up-to-date peer to heal from.
"""

from __future__ import annotations

from phalanx.controller.records import Pending, Quorum, QuorumMember, RoleState, StateRecords
from phalanx.controller.tick import Tick

QUORUM_HISTORY = 8
"""Formed quorums kept per role, so that a retried request finds its answer."""


class QuorumRequests(StateRecords):
    def request_quorum(
        self,
        replica_id: str,
        step: int,
        request_id: str,
        timeout_s: float,
        *,
        now: float,
        wall: float,
    ) -> tuple[Quorum | None, Tick]:
        """Ask to take part in the role's next quorum, at ``step`` (this replica's
        committed step). Returns the quorum if it formed now (or was formed
        earlier for the same ``request_id``: retries are idempotent), else None
        and the caller waits for a :class:`Tick` that names it."""
        m = self.member(replica_id)
        m.last_seen = now
        done = self.answer(replica_id, request_id)
        if done is not None:
            return done, Tick()
        rs = self.roles[m.role]
        rs.add_pending(replica_id, Pending(step, request_id, now + timeout_s), now)
        tick = Tick()
        q = self._try_form(rs, now, wall)
        if q is not None:
            tick.formed.append(q)
        return self.answer(replica_id, request_id), tick

    def answer(self, replica_id: str, request_id: str) -> Quorum | None:
        m = self.members.get(replica_id)
        if m is None or m.last_request_id != request_id or m.last_round is None:
            return None
        for q in reversed(self.roles[m.role].quorums):
            if q.round == m.last_round:
                return q
        return None

    def _ready(self, rs: RoleState, now: float) -> bool:
        pend = len(rs.pending)
        if pend == 0:
            return False
        n_alive = len(rs.member_ids)
        first = rs.last_quorum is None
        need = rs.cfg.n_init_replicas if first else rs.cfg.min_replicas
        if pend < need or 2 * pend <= n_alive:
            return False  # too few, or not a majority of the heartbeating replicas
        if pend == n_alive:
            return True  # everyone who is alive has asked
        last = rs.last_quorum
        if last is not None and rs.prev_pending == len(rs.prev_ids):
            return True  # fast path: the previous quorum rejoined in full
        # Stragglers are timed from the round's start: the first of the previous
        # quorum to ask again. Replicas that asked before it (a joiner, or one left
        # out of the last round) must not start the clock, or the next quorum forms
        # at the first finisher's request and leaves the others out; the one left
        # out asks early in turn, and every later round forms short and heals.
        since = rs.prev_since
        if since is None:
            if last is not None and any(rid in rs.member_ids for rid in rs.prev_ids):
                return False  # the previous quorum's live members are still in their step
            since = rs.pending_since
        assert since is not None
        return now - since >= rs.cfg.join_timeout_s

    def _try_form(self, rs: RoleState, now: float, wall: float) -> Quorum | None:
        if not self._ready(rs, now):
            return None
        ids = sorted(rs.pending)
        last = rs.last_quorum
        if last is None or rs.force_bump or ids != sorted(last.replica_ids):
            rs.quorum_id += 1
        rs.force_bump = False
        rs.round += 1
        steps = {rid: rs.pending[rid].step for rid in ids}
        max_step = max(steps.values())
        fresh = [rid for rid in ids if steps[rid] == max_step]
        lagging = [rid for rid in ids if steps[rid] < max_step]
        heal = {rid: fresh[i % len(fresh)] for i, rid in enumerate(lagging)}
        ready = []
        members = tuple(
            QuorumMember(
                rid,
                self.members[rid].name,
                self.members[rid].address,
                self.members[rid].ranks,
                steps[rid],
                rank,
            )
            for rank, rid in enumerate(ids)
        )
        q = Quorum(
            rs.name, rs.quorum_id, rs.round, members, max_step, heal, wall, max(rs.step, max_step)
        )
        for rid in ids:
            m = self.members[rid]
            m.last_request_id = rs.pending[rid].request_id
            m.last_round = q.round
            m.step = max(m.step, steps[rid])
            if m.active_at is None and rid not in heal:
                m.active_at = wall
                ready.append(m)
            self._put("members", rid, m.record())
        rs.set_formed(q)
        self._put("quorums", f"{rs.name}/{q.round:012d}", q.record())
        if len(rs.quorums) > QUORUM_HISTORY:
            old = rs.quorums.pop(0)
            self._put("quorums", f"{rs.name}/{old.round:012d}", None)
        if max_step > rs.step:
            rs.steps_seen.append((now, max_step))
        rs.step = max(rs.step, max_step)
        self._save_role(rs)
        recovered = [
            {
                "replica_id": f["replica_id"],
                "detector": f["detector"],
                "seconds": round(wall - f["failed_at"], 3),
            }
            for f in rs.failures
        ]
        rs.failures.clear()
        self._event(
            "quorum",
            wall,
            role=rs.name,
            quorum_id=q.quorum_id,
            round=q.round,
            size=len(ids),
            max_step=max_step,
            healing=len(heal),
            **({"heal": dict(heal)} if heal else {}),
            **({"recovered": recovered} if recovered else {}),
        )
        for m in ready:
            self._event(
                "active",
                wall,
                role=rs.name,
                replica_id=m.replica_id,
                join_s=round(wall - m.registered_at, 3),
            )
        return q

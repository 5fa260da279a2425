"""The controller's logic as a pure state machine.

No I/O, no threads, no clock of its own: every method takes ``now`` (a
monotonic time in seconds), and everything random (incarnation ids) is
passed in. Given the same calls, it makes the same decisions, which is what
lets the hypothesis tests drive it through joins, failures, clock jumps and
restarts.

Durability works by *changes*: every mutation of durable state appends a
``(table, key, record | None)`` to :attr:`ControllerState.changes`. The
server drains them into the journal (one SQLite transaction) before it
answers the request that caused them, and :meth:`ControllerState.restore`
rebuilds the state from the journal's tables. Liveness (last heartbeat,
suspicion, pending quorum requests) is deliberately not durable: after a
restart every member gets a fresh heartbeat grace and re-asks for its
quorum, which the client does by itself.

This module holds membership, failure detection, the deadlines, restore and
the status. The rest is put together from:

- :mod:`~phalanx.controller.records`: the records and their journaling;
- :mod:`~phalanx.controller.quorum`: quorum formation and heal assignment;
- :mod:`~phalanx.controller.commands`: command queues, operator actions and
  checkpoint records;
- :mod:`~phalanx.controller.rl_requests`: the RL ledger's requests.
"""

from __future__ import annotations

from typing import Any

from phalanx.config import JobConfig
from phalanx.controller.commands import CommandQueues
from phalanx.controller.overview import detector_of, overview
from phalanx.controller.quorum import QuorumRequests
from phalanx.controller.records import Command, Member, Quorum, RoleState
from phalanx.controller.rl_requests import RLRequests
from phalanx.controller.tick import Conflict, StateError, Tick, UnknownReplica

# Besides ControllerState, this module's API re-exports the names its callers
# handle (the records live in records.py, the refusals and Tick in tick.py).
__all__ = [
    "Conflict",
    "ControllerState",
    "Member",
    "Quorum",
    "RoleState",
    "StateError",
    "Tick",
    "UnknownReplica",
]


class ControllerState(QuorumRequests, CommandQueues, RLRequests):
    """Membership, quorums and command queues of one job."""

    def start(self, now: float, wall: float) -> None:
        """Begin a new controller epoch (call once per process start, after restore)."""
        self.epoch += 1
        self._put("meta", "epoch", {"value": self.epoch})
        self._event("controller_start", wall, epoch=self.epoch)

    @classmethod
    def restore(
        cls, cfg: JobConfig, tables: dict[str, dict[str, dict[str, Any]]], now: float
    ) -> ControllerState:
        """Rebuild from the journal's tables. Every member gets a fresh heartbeat grace."""
        st = cls(cfg)
        meta = tables.get("meta", {})
        st.epoch = meta.get("epoch", {}).get("value", 0)
        st.command_seq = meta.get("command_seq", {}).get("value", 0)
        st.event_seq = meta.get("event_seq", {}).get("value", 0)
        for name, role in st.roles.items():
            m = meta.get(f"role/{name}")
            if m:
                role.quorum_id, role.round = m["quorum_id"], m["round"]
                role.step, role.force_bump = m["step"], m["force_bump"]
        for key in sorted(tables.get("quorums", {})):
            q = Quorum.from_record(tables["quorums"][key])
            if q.role in st.roles:
                st.roles[q.role].set_formed(q)
        for rec in tables.get("members", {}).values():
            if rec["role"] not in st.roles:
                continue  # role removed from the config: the member cannot take part
            mem = Member(**rec, last_seen=now)
            st.members[mem.replica_id] = mem
            st._by_name[(mem.role, mem.name)] = mem.replica_id
            st.roles[mem.role].member_ids.add(mem.replica_id)
        for rec in tables.get("commands", {}).values():
            c = Command(**rec)
            if c.replica_id in st.members:
                st.commands.setdefault(c.replica_id, {})[c.id] = c
        st.events = [tables["events"][k] for k in sorted(tables.get("events", {}))]
        st.desired = {
            k.removeprefix("desired/"): v["value"]
            for k, v in meta.items()
            if k.startswith("desired/") and k.removeprefix("desired/") in st.roles
        }
        st.checkpoints = [tables["checkpoints"][k] for k in sorted(tables.get("checkpoints", {}))]
        if st.ledger is not None:
            st.ledger.restore(tables, now)
        st.queues.restore(tables, now)
        return st

    # -- membership ------------------------------------------------------

    def register(
        self,
        role: str,
        name: str,
        incarnation: str,
        *,
        now: float,
        wall: float,
        ranks: int = 1,
        address: str = "",
        capabilities: dict[str, Any] | None = None,
    ) -> tuple[Member, Tick]:
        """Add a replica. A live member with the same role and name is an older
        incarnation of the same process: it is evicted first."""
        rs = self._role(role)
        tick = Tick()
        rid = f"{name}:{incarnation}"
        # Checked before evicting the old incarnation: a reused id must be refused
        # without side effects, not evict the live member and revive its id.
        if rid in self.members:
            raise Conflict(f"replica id {rid!r} is already registered; use a fresh incarnation.")
        old = self._by_name.get((role, name))
        if old is not None:
            tick.merge(self._evict(old, "replaced by a new incarnation", now, wall))
        m = Member(rid, rs.name, name, ranks, address, dict(capabilities or {}), wall)
        m.last_seen = now
        self.members[rid] = m
        self._by_name[(role, name)] = rid
        rs.member_ids.add(rid)
        self._put("members", rid, m.record())
        self._event("join", wall, role=role, replica_id=rid)
        return m, tick

    def heartbeat(
        self,
        replica_id: str,
        *,
        now: float,
        wall: float = 0.0,
        step: int | None = None,
        loss: float | None = None,
        inner_step: int | None = None,
        healed: dict[str, Any] | None = None,
    ) -> None:
        m = self.member(replica_id)
        m.last_seen = now
        m.suspect_since = None
        if healed is not None:
            self._event("healed", wall, role=m.role, replica_id=replica_id, **healed)
        if inner_step is not None:
            m.inner_step = inner_step
        rs = self.roles[m.role]
        if loss is not None and step is not None:
            m.loss = loss
            if not rs.losses or step > rs.losses[-1][0]:
                rs.losses.append((step, loss))
        if step is not None and step > m.step:
            m.step = step
            self._put("members", replica_id, m.record())
            self._bump_step(rs, step, now)

    def deregister(self, replica_id: str, reason: str = "", *, now: float, wall: float) -> Tick:
        self.member(replica_id)
        return self._evict(replica_id, f"left: {reason}" if reason else "left", now, wall)

    def _evict(self, replica_id: str, reason: str, now: float, wall: float) -> Tick:
        m = self.members.pop(replica_id)
        del self._by_name[(m.role, m.name)]
        self._put("members", replica_id, None)
        for cid in self.commands.pop(replica_id, {}):
            self._put("commands", f"{cid:012d}", None)
        rs = self.roles[m.role]
        rs.member_ids.discard(replica_id)
        rs.drop_pending(replica_id)
        # When it failed, as well as the controller can tell: the suspicion's start,
        # else its last heartbeat (for a timeout), else now.
        detector = detector_of(reason)
        since = m.suspect_since if m.suspect_since is not None else m.last_seen
        failed_at = wall - (now - since) if detector not in ("agent", "operator") else wall
        if detector not in ("left", "operator"):
            rs.failures.append(
                {"replica_id": replica_id, "detector": detector, "failed_at": failed_at}
            )
        self._event(
            "evict",
            wall,
            role=m.role,
            replica_id=replica_id,
            reason=reason,
            detector=detector,
            failed_at=round(failed_at, 3),
            uptime_s=round(wall - m.registered_at, 3),
        )
        tick = Tick(evicted=[replica_id])
        if self.ledger is not None and self.ledger.drop_replica(replica_id, wall):
            tick.ledger_for |= self.roles["rollout"].member_ids
        # One fewer live member can complete a waiting quorum.
        q = self._try_form(rs, now, wall)
        if q is not None:
            tick.formed.append(q)
        return tick

    # -- failure detection -----------------------------------------------

    def report_failure(
        self,
        reporter: str,
        suspects: list[str],
        *,
        now: float,
        wall: float,
        reason: str = "",
        failed_commit: bool = False,
    ) -> tuple[list[str], Tick]:
        """A peer saw a collective error. Returns the suspects that are unknown.

        Suspects are not evicted on the report alone (a report may be false,
        or come from the faulty side of a partition): each one is probed and
        evicted only if it does not heartbeat within ``suspect_grace_s``.
        ``failed_commit`` forces a new ``quorum_id`` at the reporter's role's
        next quorum, so that every participant rebuilds its process group.
        """
        rep = self.member(reporter, field="reporter")
        if reporter in suspects:
            raise StateError("suspects must not include the reporter itself.", field="suspects")
        tick = Tick()
        unknown = []
        for sid in dict.fromkeys(suspects):
            m = self.members.get(sid)
            if m is None:
                unknown.append(sid)
                continue
            if m.suspect_since is None:
                m.suspect_since, m.suspect_reason = now, "failure report"
                tick.probe.append(sid)
        rs = self.roles[rep.role]
        if failed_commit and not rs.force_bump:
            rs.force_bump = True
            self._save_role(rs)
        self._event(
            "failure_report",
            wall,
            reporter=reporter,
            suspects=list(suspects),
            reason=reason[:200],
            failed_commit=failed_commit,
        )
        return unknown, tick

    def suspect(self, replica_id: str, reason: str, *, now: float, wall: float) -> Tick:
        """Suspect a member on the controller's own evidence (its held connection
        dropped). Like a peer's report: evicted unless it heartbeats within
        ``suspect_grace_s``. Unknown or already suspect members are left alone."""
        m = self.members.get(replica_id)
        if m is None or m.suspect_since is not None:
            return Tick()
        m.suspect_since, m.suspect_reason = now, reason
        self._event("suspect", wall, replica_id=replica_id, reason=reason)
        return Tick(probe=[replica_id])

    def tick(self, *, now: float, wall: float) -> Tick:
        """Apply deadlines: heartbeat timeouts, suspect graces, stale quorum requests,
        join timeouts. Call it often (every ``controller.tick_s``)."""
        t = self.cfg.timeouts
        tick = Tick()
        # Stale requests go first: an eviction below may form a quorum, and it
        # must not count a replica whose request timed out (it gave up waiting).
        for rs in self.roles.values():
            stale = [rid for rid, p in rs.pending.items() if p.deadline <= now]
            for rid in stale:
                rs.drop_pending(rid)
        for m in list(self.members.values()):
            if m.suspect_since is not None and now - m.suspect_since >= t.suspect_grace_s:
                reason = f"{m.suspect_reason}, no heartbeat in grace"
                tick.merge(self._evict(m.replica_id, reason, now, wall))
            elif now - m.last_seen >= t.heartbeat_s:
                tick.merge(self._evict(m.replica_id, "heartbeat timeout", now, wall))
        for rs in self.roles.values():
            q = self._try_form(rs, now, wall)
            if q is not None:
                tick.formed.append(q)
        if self.ledger is not None:
            if self.ledger.expire(now, wall):
                tick.ledger_for |= self.roles["rollout"].member_ids
            tick.merge(self._maybe_sync(now, wall))
        return tick

    # -- status ----------------------------------------------------------

    def status(self, now: float, wall: float | None = None) -> dict[str, Any]:
        roles = {}
        for name, rs in self.roles.items():
            last = rs.last_quorum
            roles[name] = {
                **rs.meta(),
                "config": rs.cfg.model_dump(),
                "pending": sorted(rs.pending),
                "quorum": last.record() if last else None,
                "replicas": [
                    {
                        **m.record(),
                        "seconds_since_heartbeat": round(now - m.last_seen, 3),
                        "suspect": m.suspect_since is not None,
                        "commands_pending": len(self.commands.get(m.replica_id, {})),
                    }
                    for m in sorted(self.alive(name), key=lambda m: m.replica_id)
                ],
            }
        for name in roles:
            roles[name]["desired"] = self.desired.get(name)
        out = {
            "job_id": self.cfg.job.id,
            "epoch": self.epoch,
            "roles": roles,
            "events": self.events[-100:],
        }
        out["checkpoints"] = {
            "latest": self.checkpoints[-1] if self.checkpoints else None,
            "committed": self.checkpoints[-10:],
        }
        if self.ledger is not None:
            out["rl"] = self.ledger.status()
        if self.queues.books:
            out["queues"] = self.queues.status()
        out["overview"] = overview(self, now, wall)
        return out

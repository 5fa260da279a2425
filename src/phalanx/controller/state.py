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
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from phalanx.config import JobConfig, RoleSection
from phalanx.controller.ledger import Ledger
from phalanx.controller.overview import detector_of, overview
from phalanx.controller.rl_requests import RLRequests
from phalanx.controller.tick import Conflict, StateError, Tick, UnknownReplica

__all__ = ["Conflict", "ControllerState", "Quorum", "StateError", "Tick", "UnknownReplica"]

QUORUM_HISTORY = 8
CHECKPOINT_HISTORY = 20
"""Formed quorums kept per role, so that a retried request finds its answer."""


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

    def record(self) -> dict[str, Any]:
        d = asdict(self)
        del d["last_seen"], d["suspect_since"], d["suspect_reason"], d["loss"]
        return d


@dataclass(frozen=True)
class QuorumMember:
    replica_id: str
    name: str
    address: str
    ranks: int
    step: int
    rank: int
    """This replica's rank within the quorum (sorted by replica id)."""


@dataclass(frozen=True)
class Quorum:
    role: str
    quorum_id: int
    """Epoch of the membership: changes iff membership changes or a commit failed."""
    round: int
    """Formation counter: one more for every quorum formed for this role."""
    members: tuple[QuorumMember, ...]
    max_step: int
    heal: dict[str, str]
    """Lagging replica id -> the up-to-date replica id that heals it."""
    formed_at: float
    job_step: int = 0
    """Highest step the role ever committed (survives restarts). A quorum whose
    ``max_step`` is below it means no live replica holds the job's latest state."""

    @property
    def replica_ids(self) -> list[str]:
        return [m.replica_id for m in self.members]

    def record(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_record(d: dict[str, Any]) -> Quorum:
        members = tuple(QuorumMember(**m) for m in d["members"])
        return Quorum(**{**d, "members": members})


@dataclass
class Pending:
    step: int
    request_id: str
    deadline: float


@dataclass
class Command:
    id: int
    replica_id: str
    kind: str
    payload: dict[str, Any]
    created_at: float


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
    prev_ids: frozenset[str] = frozenset()
    prev_pending: int = 0
    """How many of the previous quorum's members are pending (kept incrementally,
    so that each quorum request is O(1) and a round of N requests is O(N))."""
    failures: list[dict[str, Any]] = field(default_factory=list)
    """Evictions not yet followed by a quorum: the next quorum reports, for each,
    the time from the failure to it (not durable)."""
    steps_seen: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=64))
    """(monotonic time, step) whenever the role's step grew: the steps-per-second rate."""
    losses: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=500))
    """(step, loss) as the replicas report them with their heartbeats (not durable)."""

    @property
    def last_quorum(self) -> Quorum | None:
        return self.quorums[-1] if self.quorums else None

    def add_pending(self, replica_id: str, p: Pending, now: float) -> None:
        if replica_id not in self.pending and replica_id in self.prev_ids:
            self.prev_pending += 1
        self.pending[replica_id] = p
        if self.pending_since is None:
            self.pending_since = now

    def drop_pending(self, replica_id: str) -> None:
        if self.pending.pop(replica_id, None) is not None and replica_id in self.prev_ids:
            self.prev_pending -= 1
        if not self.pending:
            self.pending_since = None

    def set_formed(self, q: Quorum) -> None:
        self.quorums.append(q)
        self.prev_ids = frozenset(q.replica_ids)
        self.pending.clear()
        self.pending_since = None
        self.prev_pending = 0

    def meta(self) -> dict[str, Any]:
        return {
            "quorum_id": self.quorum_id,
            "round": self.round,
            "step": self.step,
            "force_bump": self.force_bump,
        }


class ControllerState(RLRequests):
    """Membership, quorums and command queues of one job."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.epoch = 0
        self.members: dict[str, Member] = {}
        self.roles = {name: RoleState(name, rc) for name, rc in cfg.roles.items()}
        self.commands: dict[str, dict[int, Command]] = {}
        self.command_seq = 0
        self.event_seq = 0
        self.events: list[dict[str, Any]] = []
        self.changes: list[tuple[str, str, dict[str, Any] | None]] = []
        self._by_name: dict[tuple[str, str], str] = {}
        self.checkpoints: list[dict[str, Any]] = []
        """The last CHECKPOINT_HISTORY committed checkpoints, oldest first."""
        self.desired: dict[str, int] = {}
        """Replica count per role that an operator asked for (``phalanx scale``); a
        launcher that can start and stop replicas follows it."""
        self.ledger = (
            Ledger(
                cfg.rl,
                self._put,
                self._event,
                sync_timeout_s=2 * cfg.rl.loop.sync_timeout_s + cfg.timeouts.heartbeat_s,
            )
            if cfg.rl is not None
            else None
        )

    # -- durable records -------------------------------------------------

    def _put(self, table: str, key: str, record: dict[str, Any] | None) -> None:
        self.changes.append((table, key, record))

    def drain(self) -> list[tuple[str, str, dict[str, Any] | None]]:
        out, self.changes = self.changes, []
        return out

    def _event(self, kind: str, wall: float, **fields: Any) -> None:
        self.event_seq += 1
        ev = {"seq": self.event_seq, "kind": kind, "at": wall, **fields}
        self.events.append(ev)
        self._put("events", f"{self.event_seq:012d}", ev)
        keep = self.cfg.controller.history
        while len(self.events) > keep:
            old = self.events.pop(0)
            self._put("events", f"{old['seq']:012d}", None)
        self._put("meta", "event_seq", {"value": self.event_seq})

    def _save_role(self, role: RoleState) -> None:
        self._put("meta", f"role/{role.name}", role.meta())

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
        return st

    # -- lookups ---------------------------------------------------------

    def _role(self, role: str) -> RoleState:
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
    ) -> None:
        m = self.member(replica_id)
        m.last_seen = now
        m.suspect_since = None
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

    def _bump_step(self, rs: RoleState, step: int, now: float) -> None:
        if step > rs.step:
            rs.step = step
            rs.steps_seen.append((now, step))
            self._save_role(rs)

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

    # -- quorum ----------------------------------------------------------

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
        assert rs.pending_since is not None
        return now - rs.pending_since >= rs.cfg.join_timeout_s

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

    # -- commands --------------------------------------------------------

    def enqueue(
        self, target: str, kind: str, payload: dict[str, Any], *, now: float, wall: float
    ) -> tuple[list[Command], Tick]:
        """Queue a command for one replica (by id) or every member of a role (by name)."""
        if target in self.roles:
            ids = sorted(m.replica_id for m in self.alive(target))
        else:
            ids = [self.member(target, field="target").replica_id]
        out = []
        for rid in ids:
            self.command_seq += 1
            c = Command(self.command_seq, rid, kind, dict(payload), wall)
            self.commands.setdefault(rid, {})[c.id] = c
            self._put("commands", f"{c.id:012d}", asdict(c))
            out.append(c)
        self._put("meta", "command_seq", {"value": self.command_seq})
        return out, Tick(commands_for=set(ids))

    def pending_commands(self, replica_id: str, after: int = 0) -> list[Command]:
        self.member(replica_id)
        q = self.commands.get(replica_id, {})
        return [q[cid] for cid in sorted(q) if cid > after]

    def ack(self, replica_id: str, command_ids: list[int]) -> list[int]:
        """Acknowledge commands; returns the ids that were not pending (already acked)."""
        self.member(replica_id)
        q = self.commands.get(replica_id, {})
        missing = []
        for cid in command_ids:
            if q.pop(cid, None) is None:
                missing.append(cid)
            else:
                self._put("commands", f"{cid:012d}", None)
        return missing

    # -- scale -----------------------------------------------------------

    def set_desired(self, role: str, replicas: int, *, now: float, wall: float) -> dict[str, int]:
        """Record the replica count an operator wants for ``role``."""
        self._role(role)
        self.desired[role] = replicas
        self._put("meta", f"desired/{role}", {"value": replicas})
        self._event("scale", wall, role=role, replicas=replicas)
        return dict(self.desired)

    # -- checkpoints -----------------------------------------------------

    def record_checkpoint(
        self, replica_id: str, step: int, url: str, nbytes: int, *, now: float, wall: float
    ) -> dict[str, Any]:
        """A replica committed a checkpoint of ``step`` at ``url``: remember it
        (the job's latest restorable step is in the status)."""
        m = self.member(replica_id)
        # The saver knows its step committed before the controller does (it learns
        # of commits from the next quorum request or heartbeat).
        self._bump_step(self.roles[m.role], step, now)
        rec = {
            "step": step,
            "url": url,
            "nbytes": nbytes,
            "by": replica_id,
            "role": m.role,
            "at": wall,
        }
        self.checkpoints = sorted(
            [c for c in self.checkpoints if c["step"] != step] + [rec], key=lambda c: c["step"]
        )
        self._put("checkpoints", f"{step:012d}", rec)
        while len(self.checkpoints) > CHECKPOINT_HISTORY:
            old = self.checkpoints.pop(0)
            self._put("checkpoints", f"{old['step']:012d}", None)
        self._event("checkpoint", wall, replica_id=replica_id, step=step, url=url, nbytes=nbytes)
        return rec

    # -- status ----------------------------------------------------------

    # -- operator actions (the dashboard) -----------------------------------

    def evict_replica(self, replica_id: str, reason: str = "", *, now: float, wall: float) -> Tick:
        """An operator evicts a replica. The process, if alive, gets 410 at its next
        call and registers again as a new incarnation."""
        self.member(replica_id)
        return self._evict(
            replica_id, f"evicted by operator: {reason or 'no reason given'}", now, wall
        )

    def drain_replica(
        self, replica_id: str, *, now: float, wall: float
    ) -> tuple[list[Command], Tick]:
        """Ask a replica to leave at its next step boundary (a ``drain`` command)."""
        cmds, tick = self.enqueue(replica_id, "drain", {}, now=now, wall=wall)
        self._event("drain", wall, role=self.members[replica_id].role, replica_id=replica_id)
        return cmds, tick

    def request_checkpoint(
        self, lead: int, *, now: float, wall: float
    ) -> tuple[list[Command], Tick]:
        """Ask the policy replicas to checkpoint the step ``lead`` steps from the
        role's current one: the same step on every replica, far enough ahead that
        each has polled its commands by then."""
        rs = self._role("policy")
        if not self.cfg.checkpoint.url:
            raise Conflict(
                "checkpoint.url must be set to trigger a checkpoint: got none. Set "
                "[checkpoint] url in the job config."
            )
        step = rs.step + max(1, lead)
        cmds, tick = self.enqueue("policy", "checkpoint", {"step": step}, now=now, wall=wall)
        self._event("checkpoint_requested", wall, role="policy", step=step, replicas=len(cmds))
        return cmds, tick

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
        out["overview"] = overview(self, now, wall)
        return out

"""What the controller's state machine holds, and how its changes are journaled.

The records (members, quorums, pending quorum requests, commands, each role's
counters) and :class:`StateRecords`, the base that owns them: the journaling
of changes, the event log and the lookups. The requests that change them are
the mixins built on it (:mod:`~phalanx.controller.quorum`,
:mod:`~phalanx.controller.commands`,
:mod:`~phalanx.controller.rl_requests`), put together as
:class:`~phalanx.controller.state.ControllerState`.

Like the rest of the state machine, nothing here does I/O or reads a clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from phalanx.config import JobConfig, RoleSection
from phalanx.controller.ledger import Ledger
from phalanx.controller.queue_book import RolloutQueues
from phalanx.controller.tick import StateError, Tick, UnknownReplica

Change = tuple[str, str, dict[str, Any] | None]
"""``(table, key, record)``: one row the journal must write (``None`` deletes it)."""


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
    inner_step: int | None = field(default=None, compare=False)

    def record(self) -> dict[str, Any]:
        """The durable fields: those marked ``compare=False`` are liveness and figures."""
        d = asdict(self)
        for f in fields(self):
            if not f.compare:
                del d[f.name]
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
    prev_since: float | None = None
    """When the first of the previous quorum's members asked again: the start of the
    round, from which stragglers are timed (``join_timeout_s``)."""
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
            if self.prev_since is None:
                self.prev_since = now
        self.pending[replica_id] = p
        if self.pending_since is None:
            self.pending_since = now

    def drop_pending(self, replica_id: str) -> None:
        if self.pending.pop(replica_id, None) is not None and replica_id in self.prev_ids:
            self.prev_pending -= 1
            if self.prev_pending == 0:
                self.prev_since = None
        if not self.pending:
            self.pending_since = None

    def set_formed(self, q: Quorum) -> None:
        self.quorums.append(q)
        self.prev_ids = frozenset(q.replica_ids)
        self.pending.clear()
        self.pending_since = None
        self.prev_pending = 0
        self.prev_since = None

    def meta(self) -> dict[str, Any]:
        return {
            "quorum_id": self.quorum_id,
            "round": self.round,
            "step": self.step,
            "force_bump": self.force_bump,
        }


class StateRecords:
    """The records of one job, the journaling of their changes, and lookups.

    The base of every part of the state machine; not used on its own."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.epoch = 0
        self.members: dict[str, Member] = {}
        self.roles = {name: RoleState(name, rc) for name, rc in cfg.roles.items()}
        self.commands: dict[str, dict[int, Command]] = {}
        self.command_seq = 0
        self.event_seq = 0
        self.events: list[dict[str, Any]] = []
        self.changes: list[Change] = []
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
        self.queues = RolloutQueues(self._put)
        """The controller's named rollout queues (the ``controller`` queue backend)."""

    # -- durable records -------------------------------------------------

    def _put(self, table: str, key: str, record: dict[str, Any] | None) -> None:
        self.changes.append((table, key, record))

    def drain(self) -> list[Change]:
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

    def _bump_step(self, rs: RoleState, step: int, now: float) -> None:
        if step > rs.step:
            rs.step = step
            rs.steps_seen.append((now, step))
            self._save_role(rs)

    def _evict(self, replica_id: str, reason: str, now: float, wall: float) -> Tick:
        raise NotImplementedError  # provided by ControllerState

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

"""The controller's logic as a pure state machine, composed of its parts.

No I/O, no threads, no clock of its own: every request takes ``now`` (a
monotonic time in seconds) and ``wall``, and everything random (incarnation
ids, the RL run id) is passed in. Given the same calls, it makes the same
decisions, which is what lets the hypothesis tests drive it through joins,
failures, clock jumps and restarts.

Durability works by *changes*: every mutation of durable state appends a
``(table, key, record | None)`` to the shared :class:`ChangeLog`. The service
drains them into the journal (one SQLite transaction) before it answers the
request that caused them, and :meth:`ControllerState.restore` rebuilds the
state from the journal's tables. Liveness (heartbeats, suspicion, pending quorum
requests) is not durable: after a restart every member gets a fresh heartbeat
grace and re-asks for its quorum, which the client does by itself.

The parts, each a class of its own:

- :class:`~.membership.Membership`: members, heartbeats, suspicion;
- :class:`~.quorum.Quorums`: quorum formation and heal assignment;
- :class:`~.commands.Commands` and :class:`~.commands.CheckpointBook`, and the
  operator's actions on them (:class:`~.actions.OperatorActions`);
- :class:`~.ledger.Ledger`: the RL ledger, whose requests are :attr:`ControllerState.rl`
  (:class:`~.rl.RLRequests`).

This class orchestrates what spans parts (an eviction touches all of them)
and is the one API the service calls.
"""

from __future__ import annotations

from typing import Any

from phalanx.config import JobConfig
from phalanx.controller.core.actions import OperatorActions
from phalanx.controller.core.base import (
    RETIRED_TABLES,
    ChangeLog,
    Conflict,
    PayloadOf,
    StateError,
    Tick,
    UnknownReplica,
)
from phalanx.controller.core.commands import CheckpointBook, Commands
from phalanx.controller.core.ledger import Ledger, payload_key
from phalanx.controller.core.membership import Membership
from phalanx.controller.core.quorum import Quorums
from phalanx.controller.core.records import Member, RoleState
from phalanx.controller.core.rl import RLRequests
from phalanx.controller.core.status import status_of
from phalanx.controller.core.steps import step_rules
from phalanx.controller.core.stragglers import Stragglers
from phalanx.protocol.membership import Quorum
from phalanx.protocol.status import Status

__all__ = [
    "Conflict",
    "ControllerState",
    "Member",
    "Quorum",
    "StateError",
    "Tick",
    "UnknownReplica",
]


def _no_payloads(key: str) -> Any:
    return None


class ControllerState(OperatorActions):
    """Membership, quorums, commands and the RL ledger of one job."""

    def __init__(self, cfg: JobConfig, *, run: str = "run", payload_of: PayloadOf = _no_payloads):
        self.cfg = cfg
        self.epoch = 0
        self.log = ChangeLog(cfg.controller.history)
        self.roles = {name: RoleState(name, rc) for name, rc in cfg.roles.items()}
        self.membership = Membership(cfg, self.log, self.roles)
        self.quorums = Quorums(
            self.log,
            self.roles,
            self.membership,
            step_rules(cfg, lambda: self.ledger),
        )
        self.stragglers = Stragglers(cfg.controller.stragglers, self.log)
        """Slow replicas' share weights, which each quorum carries (``Quorum.shares``)."""
        self.quorums.shares = self.stragglers.shares
        self.commands = Commands(self.log)
        self.checkpoints = CheckpointBook(self.log)
        self.desired: dict[str, int] = {}
        """Replica count per role an operator asked for (``phalanx scale``)."""
        self.ledger = (
            Ledger(
                cfg.rl,
                self.log,
                run=run,
                sync_timeout_s=2 * cfg.rl.loop.sync_timeout_s + cfg.timeouts.heartbeat_s,
                external_store=cfg.rl.transport.rollouts != "controller",
                first_mesh_hold_s=cfg.timeouts.quorum_s,  # as a first quorum waits
                seed=cfg.job.seed,
            )
            if cfg.rl is not None
            else None
        )
        self.rl = RLRequests(self.ledger, self.membership, self.roles, self.envelope, payload_of)
        self.payload_of = payload_of
        self.moved: list[tuple[str, Any]] = []
        """Payloads a restore moved out of an old journal's records, for the payload log."""

    # -- shared records ----------------------------------------------------

    @property
    def members(self) -> dict[str, Member]:
        return self.membership.members

    @property
    def events(self) -> list[dict[str, Any]]:
        return self.log.events

    @property
    def event_seq(self) -> int:
        return self.log.event_seq

    def drain(self) -> list[tuple[str, str, dict[str, Any] | None]]:
        return self.log.drain()

    def member(self, replica_id: str, field: str = "replica_id") -> Member:
        return self.membership.member(replica_id, field)

    def envelope(self) -> dict[str, Any]:
        """What every reply carries: the epoch (it changes at a restart), the job id."""
        return {"epoch": self.epoch, "job_id": self.cfg.job.id}

    def alive(self, role: str) -> list[Member]:
        return self.membership.alive(role)

    # -- lifecycle ---------------------------------------------------------

    def start(self, now: float, wall: float) -> None:
        """Begin a new controller epoch (call once per process start, after restore)."""
        self.epoch += 1
        self.log.put("meta", "epoch", {"value": self.epoch})
        self.log.event("controller_start", wall, epoch=self.epoch)
        for tbl, key, why in self.log.dropped:
            self.log.event("journal_record_dropped", wall, table=tbl, key=key, reason=why)

    @classmethod
    def restore(
        cls,
        cfg: JobConfig,
        tables: dict[str, dict[str, dict[str, Any]]],
        now: float,
        *,
        run: str = "run",
        payload_of: PayloadOf = _no_payloads,
    ) -> ControllerState:
        """Rebuild from the journal's tables. Every member gets a fresh heartbeat grace.
        ``payload_of`` looks up the payload log (restored first), to check it holds
        what the records refer to."""
        st = cls(cfg, run=run, payload_of=payload_of)
        meta = tables.get("meta", {})
        st.epoch = meta.get("epoch", {}).get("value", 0)
        st.log.restore(tables)
        st.quorums.restore(tables)
        st.membership.restore(tables, now)
        st.quorums.recall(tables)
        st.commands.restore(tables, set(st.members))
        st.checkpoints.restore(tables)
        st.desired = {
            k.removeprefix("desired/"): v["value"]
            for k, v in meta.items()
            if k.startswith("desired/") and k.removeprefix("desired/") in st.roles
        }
        st.moved = st.ledger.restore(tables, now) if st.ledger is not None else []
        for tbl in RETIRED_TABLES:
            for key in tables.get(tbl, {}):
                st.log.put(tbl, key, None)
        return st

    # -- membership --------------------------------------------------------

    def register(
        self,
        role: str,
        name: str,
        incarnation: str,
        *,
        now: float,
        wall: float,
        ranks: int = 1,
        tp: int = 1,
        address: str = "",
        capabilities: dict[str, Any] | None = None,
        step: int = 0,
        state_root: str = "",
        root_id: str = "",
    ) -> tuple[Member, Tick]:
        """Add a replica. A live member with the same role and name is an older
        incarnation of the same process: it is evicted first. ``step`` is the newest
        committed step it holds or its checkpoint root can load (a quorum behind the
        role's step waits for it); its ``state_root`` must be its live peers'."""
        m, old = self.membership.add(
            role,
            name,
            incarnation,
            now=now,
            wall=wall,
            ranks=ranks,
            tp=tp,
            address=address,
            capabilities=capabilities or {},
            step=step,
            state_root=state_root,
            root_id=root_id,
        )
        tick = Tick()
        if old is not None:
            tick.merge(self._evict(old, "replaced by a new incarnation", now, wall))
        self.membership.admit(m, wall)
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
        self.membership.heartbeat(
            replica_id,
            now=now,
            wall=wall,
            step=step,
            loss=loss,
            inner_step=inner_step,
            healed=healed,
        )

    def deregister(self, replica_id: str, reason: str = "", *, now: float, wall: float) -> Tick:
        self.member(replica_id)
        return self._evict(replica_id, f"left: {reason}" if reason else "left", now, wall)

    def _evict(self, replica_id: str, reason: str, now: float, wall: float) -> Tick:
        m = self.membership.evict(replica_id, reason, now, wall)
        self.stragglers.forget(replica_id)
        self.commands.drop_for(replica_id)
        rs = self.roles[m.role]
        rs.drop_pending(replica_id)
        if not rs.member_ids:
            rs.lost_since = None  # whoever comes next is waited for afresh
        tick = Tick(evicted=[replica_id])
        tick.merge(self.rl.evicted(replica_id, wall))
        # One fewer live member can complete a waiting quorum.
        q = self.quorums.try_form(rs, now, wall)
        if q is not None:
            tick.formed.append(q)
        return tick

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

        Each suspect is probed, and evicted if it does not heartbeat within
        ``suspect_grace_s`` (a report may be false, or from the faulty side of a
        partition), or at once if most of its peers reported it (:meth:`Membership.
        reported`). ``failed_commit`` forces a new ``quorum_id``: all regroup."""
        rep = self.member(reporter, field="reporter")
        if reporter in suspects:
            raise StateError("suspects must not include the reporter itself.", field="suspects")
        tick = Tick()
        named = list(dict.fromkeys(suspects))
        unknown = [sid for sid in named if sid not in self.members]
        # A report naming a member already gone is of a collective it was in: that
        # explains the report, which evicts no one else (they are probed, as ever).
        for sid in (sid for sid in named if sid in self.members):
            if not unknown and (why := self.membership.reported(sid, reporter, now)):
                tick.merge(self._evict(sid, why, now, wall))
            elif self.membership.suspect(sid, "failure report", now):
                tick.probe.append(sid)
        if failed_commit:
            self.quorums.force_bump(rep.role)
        self.log.event(
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
        if not self.membership.suspect(replica_id, reason, now):
            return Tick()
        self.log.event("suspect", wall, replica_id=replica_id, reason=reason)
        return Tick(probe=[replica_id])

    def refused(self, replica_id: str, *, now: float, wall: float) -> Tick:
        """A suspect's address (its rendezvous store) refused the controller's
        connection: its process is gone, so it is evicted now, not after the grace.
        A member no longer suspected (it heartbeated) is left alone."""
        m = self.members.get(replica_id)
        if m is None or m.suspect_since is None:
            return Tick()
        return self._evict(replica_id, f"{m.suspect_reason}, address refused", now, wall)

    def tick(self, *, now: float, wall: float) -> Tick:
        """Apply deadlines: heartbeat timeouts, suspect graces, stale quorum requests,
        join timeouts, prompt leases. Call it often (every ``controller.tick_s``)."""
        tick = Tick()
        # Stale requests go first: an eviction below may form a quorum, and it
        # must not count a replica whose request timed out (it gave up waiting).
        self.quorums.expire_requests(now)
        for rid, reason in self.membership.overdue(now):
            tick.merge(self._evict(rid, reason, now, wall))
        for rs in self.roles.values():
            q = self.quorums.try_form(rs, now, wall)
            if q is not None:
                tick.formed.append(q)
        return tick.merge(self.rl.tick(now, wall))

    # -- quorum ------------------------------------------------------------

    def request_quorum(
        self,
        replica_id: str,
        step: int,
        request_id: str,
        timeout_s: float,
        *,
        now: float,
        wall: float,
        lineage: int = 0,
        compute_s: float | None = None,
        samples: int | None = None,
    ) -> tuple[Quorum | None, Tick]:
        """Ask for the role's next quorum at committed ``step`` (in quorum ``lineage``):
        the quorum if it formed (retries are idempotent), else None; a Tick names it.
        ``compute_s`` and ``samples``: the replica's last share, for the straggler
        watch, which may evict the asker itself (the Tick says so; it is not asked)."""
        m = self.membership.seen(replica_id, now)
        verdict = self.stragglers.report(
            replica_id, m.name, m.role, request_id, compute_s, samples, wall=wall
        )
        if verdict.evict is not None:
            return None, self._evict(verdict.evict, verdict.reason, now, wall)
        q, formed = self.quorums.request(m, step, request_id, timeout_s, now=now, wall=wall, lineage=lineage)  # fmt: skip
        return q, Tick(formed=[formed] if formed is not None else [])

    def answer(self, replica_id: str, request_id: str) -> Quorum | None:
        return self.quorums.answer(replica_id, request_id)

    def swept(self, refs: list[str], *, now: float, wall: float) -> None:
        """The service's collector dropped these payloads from the external store."""
        if self.ledger is not None:
            self.ledger.swept(refs)

    def payload_keys(self) -> set[str]:
        """Every key of the payload log that the records refer to (a restart keeps
        these and drops the rest: payloads of a write the journal never took)."""
        keys: set[str] = set()
        led = self.ledger
        if led is not None:
            keys |= led.episodes.keys()  # the payload log's whatever the rollout store
        if led is not None and not led.external_store:
            keys |= {payload_key(rec["ref"]) for rec in led.rollouts.records.values()}
            keys |= {payload_key(ref) for ref in led.replay.refs()}
        return keys

    def reconcile(self, *, now: float, wall: float) -> Tick:
        """At start: the rollouts whose payloads the payload log lost are discarded
        and their prompts dispatched again (:meth:`Ledger.reconcile`); episode progress
        whose payload it lost is forgotten (those prompts start afresh)."""
        led = self.ledger
        if led is not None and led.episodes.reconcile(self.payload_of):
            led.save()
        if led is None or led.external_store:
            return led.take(Tick()) if led is not None else Tick()
        return led.reconcile(self.payload_of, wall=wall)

    # -- status ------------------------------------------------------------

    def status(self, now: float, wall: float | None = None) -> Status:
        return status_of(self, now, wall)

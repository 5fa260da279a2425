"""The replica side of the protocol: one :class:`ControllerClient` per replica
process (rank 0 of a replica talks to the controller on its behalf).

It registers, keeps a heartbeat and a lifeline going on background threads,
and asks for quorums, commands, prompt and batch leases, and failure reports.
Every method takes and returns the types of :mod:`phalanx.protocol`.

Failures it hides, besides the transport's retries
(:mod:`phalanx.client.transport`):

- **a restarting controller**: a controller restarted on the same state dir
  keeps the membership, so the replica just carries on; the client logs the
  new controller epoch.
- **eviction** (the controller answers 410: this incarnation is gone, e.g.
  after a SIGSTOP outlived the heartbeat timeout): the client registers a
  new incarnation under the same name and bumps :attr:`incarnations`. The
  training layer must then treat itself as a new joiner (heal).

What the training loop tells the controller goes through explicit calls:
:meth:`report_progress` (step, loss, DiLoCo inner steps) and
:meth:`report_heal`, carried by the next heartbeat.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

from phalanx.client.ledger import LedgerCalls
from phalanx.client.liveness import Liveness
from phalanx.client.members import MemberLists
from phalanx.client.transport import Evicted, QuorumTimeout, Transport
from phalanx.log import ReplicaLogger, Who
from phalanx.protocol.base import OkReply, Scalar
from phalanx.protocol.commands import (
    AckReply,
    AckReq,
    CheckpointRecord,
    CheckpointReply,
    CheckpointReq,
    Command,
    CommandsReply,
    EnqueueReq,
    PollReq,
    ScaleReply,
    ScaleReq,
)
from phalanx.protocol.membership import (
    DeregisterReq,
    HeartbeatReply,
    QuorumReply,
    QuorumReq,
    RegisterReply,
    RegisterReq,
    ReportReply,
    ReportReq,
)
from phalanx.protocol.quorum import QuorumView
from phalanx.protocol.status import Status

log = logging.getLogger("phalanx.client")

T = TypeVar("T")


class ControllerClient(LedgerCalls):
    def __init__(
        self,
        controller: str,
        role: str,
        name: str,
        *,
        ranks: int = 1,
        tp: int = 1,
        address: str = "",
        capabilities: dict[str, Scalar] | None = None,
        token: str | None = None,
        unreachable_timeout_s: float = 30.0,
        rank: int = 0,
    ):
        self.who = Who(role=role, replica_id=name, rank=rank)
        self.log = ReplicaLogger(log, self.who)
        self.transport = Transport(
            controller,
            token=token,
            unreachable_timeout_s=unreachable_timeout_s,
            on_epoch=self._epoch_changed,
        )
        self.role, self.name, self.ranks, self.tp = role, name, ranks, tp
        self.address = address
        self.capabilities = dict(capabilities or {})
        self.state_root = ""
        """The checkpoint root this replica saves to and resumes from ('' for none);
        set with :meth:`set_root` before registering."""
        self.root_id = ""
        self.resumable = 0
        """The newest step the root holds: registered as this replica's step until it
        reports a committed one (a quorum behind the job's step waits for it)."""
        self.replica_id: str | None = None
        self.incarnations = 0
        self.timeouts: RegisterReply | None = None
        self.leaving = False
        self._reg_lock = threading.Lock()
        self.liveness = Liveness(self)
        self.member_lists = MemberLists(self.transport, self.log.warning)
        """Quorum member lists, by digest: fetched once per change of membership."""

    @property
    def url(self) -> str:
        return self.transport.url

    @property
    def epoch(self) -> int | None:
        return self.transport.epoch

    def _epoch_changed(self, old: int | None, new: int) -> None:
        if old is not None:
            self.log.warning("controller restarted (epoch %s -> %s); resuming", old, new)

    # -- what the training loop reports ----------------------------------

    def report_progress(
        self, step: int | None = None, loss: float | None = None, inner_step: int | None = None
    ) -> None:
        """The replica's committed ``step``, the loss of its last commit (a non-finite
        loss is not sent) and, for DiLoCo, the inner steps taken so far; the next
        heartbeat carries them. Arguments left None keep their last value."""
        self.liveness.report(step, loss, inner_step)

    def report_heal(self, source: str, step: int, seconds: float, quorum_id: int) -> None:
        """A heal this replica finished: the next heartbeat reports it once (the
        dashboard's timeline shows it)."""
        self.liveness.report_heal(source, step, seconds, quorum_id)

    @property
    def step(self) -> int | None:
        """The committed step last reported."""
        return self.liveness.progress.step

    @property
    def heartbeats(self) -> int:
        return self.liveness.heartbeats

    @property
    def probes_answered(self) -> int:
        return self.liveness.probes_answered

    # -- membership ------------------------------------------------------

    def set_root(self, url: str, root_id: str, latest: int) -> None:
        """The checkpoint root this replica uses (:func:`phalanx.checkpoint.root.identify`):
        registered with it, and with ``latest`` as the step it can resume from."""
        self.state_root, self.root_id, self.resumable = url, root_id, latest

    def register(self) -> str:
        """Register a new incarnation of this replica, with the newest step it holds
        (its last committed one, else what its root can load). Idempotent per call
        site: a second call replaces the first incarnation."""
        req = RegisterReq(
            role=self.role,
            name=self.name,
            ranks=self.ranks,
            tp=self.tp,
            address=self.address,
            capabilities=self.capabilities,
            step=self.step if self.step is not None else self.resumable,
            state_root=self.state_root,
            root_id=self.root_id,
        )
        r = self.transport.call("/v1/register", req, RegisterReply)
        self.replica_id = r.replica_id
        self.incarnations += 1
        self.liveness.healed = None  # a heal of an earlier incarnation is not this one's
        self.timeouts = r
        self.who.replica_id = r.replica_id
        self.log.info("registered (epoch %s)", r.epoch)
        return r.replica_id

    def reregister(self, stale_id: str | None) -> None:
        """This incarnation was evicted: register a new one (once, whichever thread
        saw the 410 first)."""
        with self._reg_lock:
            if (
                self.replica_id == stale_id
                and not self.leaving
                and not self.liveness.stopped.is_set()
            ):
                self.log.warning("evicted by the controller; registering a new incarnation")
                self.register()

    def _as_member(self, fn: Callable[[str], T]) -> T:
        """Run ``fn(replica_id)``; if this incarnation was evicted, re-register and retry."""
        if self.replica_id is None:
            self.register()
        while True:
            rid = self.replica_id
            if rid is None:  # deregistered meanwhile: a new incarnation
                rid = self.register()
            try:
                return fn(rid)
            except Evicted:
                self.reregister(rid)

    def start_heartbeat(self) -> None:
        """Start the background heartbeat and lifeline threads (idempotent)."""
        if self.replica_id is None:
            self.register()
        self.liveness.start()

    def deregister(self, reason: str = "") -> None:
        """Leave the job for good: the heartbeat stops re-registering."""
        rid = self.replica_id
        if rid is None:
            return
        self.leaving = True
        try:
            # The heartbeat may not have carried the last commits yet: report them, or
            # the job's step stays behind and a replica started after the job ended
            # does not see it finished (it would train it again from scratch).
            last = self.liveness.last_word(rid)
            if last is not None:
                self.transport.call("/v1/heartbeat", last, HeartbeatReply)
            req = DeregisterReq(replica_id=rid, reason=reason[:1000])
            self.transport.call("/v1/deregister", req, OkReply)
        except Evicted:
            pass
        self.replica_id = None

    def close(self, reason: str | None = "") -> None:
        """Leave the job (deregister) and stop the heartbeat thread. ``reason=None``
        stops without deregistering (the controller then evicts the replica when its
        heartbeats stop: a tool that simulates a crash)."""
        try:
            if self.replica_id is not None and reason is not None:
                self.deregister(reason or "closed")
        finally:
            self.liveness.stop()
            self.transport.close()

    def __enter__(self) -> ControllerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- quorum ----------------------------------------------------------

    def quorum(
        self,
        step: int,
        timeout_s: float | None = None,
        lineage: int = 0,
        timing: tuple[float, int] | None = None,
    ) -> QuorumView:
        """Block until this replica is in a quorum of its role for ``step``.

        Call it once per step from the replica's rank 0, with the replica's
        committed step. Safe to retry: one call is one request id, so a
        controller that answered before a network error answers the same
        quorum again. The reply is a brief; the member list comes from
        :attr:`member_lists`, fetched only when membership changed. Raises
        :class:`QuorumTimeout` after ``timeout_s`` (default: the job's
        ``timeouts.quorum_s``). ``timing``: (seconds, samples) of this replica's
        share in the last step it computed, for the controller's straggler watch."""
        if timeout_s is None:
            timeout_s = self.timeouts.quorum_timeout_s if self.timeouts is not None else 60.0
        request_id = uuid.uuid4().hex
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise QuorumTimeout(
                    f"no quorum for role {self.role} at step {step} within {timeout_s:.1f} s: "
                    f"too few replicas asked (see min_replicas / n_init_replicas in the job config)"
                )
            wait = min(10.0, left)

            def ask(rid: str, wait: float = wait, left: float = left) -> tuple[str, QuorumReply]:
                req = QuorumReq(
                    replica_id=rid,
                    step=step,
                    request_id=request_id,
                    timeout_s=left,
                    wait_s=wait,
                    lineage=lineage,
                    compute_s=timing[0] if timing else None,
                    samples=timing[1] if timing else None,
                )
                return rid, self.transport.call("/v1/quorum", req, QuorumReply, timeout=wait + 10)

            rid, r = self._as_member(ask)
            if r.status == "ok" and r.quorum is not None:
                view = self.member_lists.view(r.quorum, rid)
                if view is None:  # the controller no longer keeps that quorum: ask again
                    continue
                self.who.quorum_id = view.quorum_id
                return view

    # -- failures and commands -------------------------------------------

    def report_failure(
        self, suspects: list[str], reason: str = "", failed_commit: bool = False
    ) -> list[str]:
        """Report peers seen failing (e.g. a collective error). Returns the suspects the
        controller did not know (already evicted)."""

        def send(rid: str) -> ReportReply:
            req = ReportReq(
                reporter=rid,
                suspects=[s for s in suspects if s != rid],
                reason=reason[:1000],
                failed_commit=failed_commit,
            )
            return self.transport.call("/v1/report-failure", req, ReportReply)

        return list(self._as_member(send).unknown)

    def poll_commands(self, after: int = 0, wait_s: float = 10.0) -> list[Command]:
        """Long-poll this replica's unacknowledged commands with id > ``after``."""

        def send(rid: str) -> CommandsReply:
            req = PollReq(replica_id=rid, after=after, wait_s=wait_s)
            return self.transport.call("/v1/commands/poll", req, CommandsReply, timeout=wait_s + 10)

        return list(self._as_member(send).commands)

    def ack(self, ids: list[int]) -> list[int]:
        def send(rid: str) -> AckReply:
            return self.transport.call(
                "/v1/commands/ack", AckReq(replica_id=rid, ids=ids), AckReply
            )

        return list(self._as_member(send).not_pending)

    def enqueue(
        self, target: str, kind: str, payload: dict[str, Any] | None = None
    ) -> list[Command]:
        """Queue a command for a replica id or for every replica of a role."""
        req = EnqueueReq(target=target, kind=kind, payload=payload or {})
        return list(self.transport.call("/v1/commands", req, CommandsReply).commands)

    def status(self) -> Status:
        return self.transport.call("/v1/status", None, Status)

    def scale(self, role: str, replicas: int) -> dict[str, int]:
        """Ask the job's launcher for ``replicas`` replicas of ``role``."""
        req = ScaleReq(role=role, replicas=replicas)
        return dict(self.transport.call("/v1/scale", req, ScaleReply).desired)

    def checkpoint_committed(self, step: int, url: str, nbytes: int) -> CheckpointRecord:
        """Tell the controller that this replica committed a checkpoint of ``step``."""

        def send(rid: str) -> CheckpointReply:
            req = CheckpointReq(replica_id=rid, step=step, url=url, nbytes=nbytes)
            return self.transport.call("/v1/checkpoints", req, CheckpointReply)

        return self._as_member(send).checkpoint

"""Membership: register, heartbeat, lifeline, quorum, failure reports, deregister."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from phalanx.protocol.base import (
    Address,
    Count,
    Key,
    Name,
    ReplicaId,
    Reply,
    RoleName,
    Scalar,
    Seconds,
    Text,
    WaitS,
    Wall,
    Wire,
)
from phalanx.protocol.quorum import QuorumBrief, Shares

RequestId = Annotated[str, Field(min_length=1, max_length=64)]


class RegisterReq(Wire):
    role: RoleName
    name: Name
    """Stable name of the replica; each registration is a new incarnation of it."""
    ranks: int = Field(1, ge=1, le=65536)
    """Processes (ranks) the replica spans."""
    tp: int = Field(1, ge=1, le=65536)
    """Its tensor-parallel degree (``[replica] tp``): with ``ranks``, its layout, which
    every live replica of a role shares (an older client sends none: 1)."""
    address: Address = ""
    capabilities: Annotated[dict[Key, Scalar], Field(max_length=64)] = {}
    step: Count = 0
    """The newest committed step this replica holds, or that its checkpoint root can
    load (a restarting replica reads its root before it joins): a quorum whose newest
    step is behind the job's waits for it instead of rolling the job back."""
    state_root: Annotated[str, Field(max_length=4096)] = ""
    """The checkpoint root this replica saves to and resumes from ('' for none). Every
    live replica of a role must name the same one: a batch is durable only once a save
    holding it commits where every later restart of the role will read it."""
    root_id: Annotated[str, Field(max_length=64)] = ""
    """The id in the root's marker file (:mod:`phalanx.checkpoint.root`): the same path
    on two hosts' local disks is two roots, which the same string would hide."""


class RegisterReply(Reply):
    replica_id: Annotated[str, Field(min_length=1, max_length=160)]
    heartbeat_interval_s: Seconds
    heartbeat_timeout_s: Seconds
    suspect_grace_s: Seconds
    quorum_timeout_s: Seconds


class HealedReport(Wire):
    """A heal this replica finished (sent once, with its next heartbeat)."""

    source: ReplicaId
    """The replica it healed from."""
    step: Count
    seconds: float = Field(ge=0, le=86400)
    quorum_id: Count


class HeartbeatReq(Wire):
    replica_id: ReplicaId
    step: Count | None = None
    """This replica's committed step."""
    loss: float | None = None
    """Training loss at ``step`` (optional; charted by the dashboard)."""
    inner_step: Count | None = None
    """DiLoCo: inner steps taken so far, the current round's included (optional;
    shown by the dashboard while a round runs)."""
    wait_s: WaitS = 0.0
    healed: HealedReport | None = None
    """A heal finished since the last heartbeat (shown on the timeline, with its time)."""


class HeartbeatReply(Reply):
    probe: bool = False
    """A peer suspects this replica: heartbeat again at once to prove it is alive."""


class LifelineReq(Wire):
    replica_id: ReplicaId
    wait_s: WaitS = 0.0
    """How long to hold the request (the client sends ``LIFELINE_HOLD_S``)."""


class QuorumReq(Wire):
    replica_id: ReplicaId
    step: Count
    """This replica's committed step."""
    request_id: RequestId
    """One per step: a retried request with the same id gets the same quorum."""
    lineage: Count = 0
    """The ``quorum_id`` in which this replica's state was committed last (0: none
    known). Of the replicas at a quorum's newest step, only those of the newest
    lineage are up to date: one that committed the step in a quorum the others did
    not follow (its collective finished where theirs timed out) is healed."""
    timeout_s: float = Field(60.0, gt=0, le=86400)
    wait_s: WaitS = 10.0
    compute_s: float | None = Field(None, ge=0, le=86400)
    """The time this replica took to compute its share of the last step it computed
    (None: not reported, as by an older client or a loop without shares). With
    ``samples``, what the controller finds stragglers from (``[controller.stragglers]``)."""
    samples: Count | None = None
    """The samples of that share."""


class QuorumMember(Wire):
    replica_id: ReplicaId
    name: Name
    address: Address
    ranks: int = Field(ge=1, le=65536)
    tp: int = Field(1, ge=1, le=65536)
    step: Count
    rank: int = Field(ge=0, le=1_000_000)
    """This replica's rank within the quorum (sorted by replica id)."""
    lineage: Count = 0
    """The quorum in which its state was committed last (``QuorumReq.lineage``)."""


class Quorum(Wire):
    """The replicas of a role that take part in its next step: the controller's
    record of a formed quorum (journaled, and shown by the status API). A replica
    gets a :class:`~phalanx.protocol.quorum.QuorumBrief` of it instead."""

    role: RoleName
    quorum_id: Count
    """Epoch of the membership: changes iff membership changes or a commit failed."""
    round: Count
    """Formation counter: one more for every quorum formed for this role."""
    members: Annotated[tuple[QuorumMember, ...], Field(max_length=100_000)]
    max_step: Count
    heal: Annotated[dict[ReplicaId, ReplicaId], Field(max_length=100_000)]
    """Lagging replica id -> the up-to-date replica id that heals it."""
    formed_at: Wall
    job_step: Count = 0
    """Highest step the role committed (survives restarts; it goes back only with an
    explicit rollback). ``max_step`` below it: the job finished at ``final_step`` and
    this quorum's replicas are behind it (they have nothing left to train)."""
    final_step: Count | None = None
    """The job's last step, once known (the FT job's configured steps; the RL job's
    once its ledger decided it): a replica behind it, with no peer that holds it in
    the quorum, stops instead of training the finished job again."""
    shares: Shares = ()
    """The share weights of the members, in rank order (thousandths of an equal
    share): every member splits the constant global batch by them alike. Empty: the
    equal split. A straggler's is smaller (:mod:`phalanx.controller.core.stragglers`)."""
    rolled_back_from: Count | None = None
    """Set on the quorum that rolled the job back: no live replica and no checkpoint
    held the job's step, which went back from this to ``max_step`` (journaled as a
    ``rollback`` event, and followed by the RL ledger)."""

    @property
    def replica_ids(self) -> list[str]:
        return [m.replica_id for m in self.members]


class QuorumReply(Reply):
    status: Literal["ok", "pending"]
    quorum: QuorumBrief | None = None
    """This replica's brief of the quorum when ``status`` is ``ok`` (the member list
    is fetched apart, once per change: :mod:`phalanx.protocol.quorum`); ask again
    with the same request id when ``pending``."""


class ReportReq(Wire):
    reporter: ReplicaId
    suspects: Annotated[list[ReplicaId], Field(max_length=1000)] = []
    reason: Text = ""
    failed_commit: bool = False
    """The reporter's step did not commit: every participant rebuilds its group."""


class ReportReply(Reply):
    unknown: Annotated[list[ReplicaId], Field(max_length=1000)]
    """Suspects that are not members (already evicted)."""


class DeregisterReq(Wire):
    replica_id: ReplicaId
    reason: Text = ""

"""The job's status (``GET /v1/status``, the dashboard's stream, ``phalanx status``).

Two views of one state: the records as the controller keeps them (roles,
members, quorums, the ledger's balance), and the ``overview``,
what the dashboard draws (replica states, series, the timeline in words).
docs/operations.md lists every field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from phalanx.protocol.base import (
    Address,
    Count,
    JobId,
    Key,
    Name,
    ReplicaId,
    Reply,
    RoleName,
    Scalar,
    Text,
    Wall,
    Wire,
)
from phalanx.protocol.commands import CheckpointRecord
from phalanx.protocol.membership import Quorum
from phalanx.protocol.rl import BatchMetrics, SignedInt, Staleness

Many = Field(max_length=100_000)
Ids = Annotated[list[ReplicaId], Many]


class Event(BaseModel):
    """One timeline event: ``seq``, ``kind``, ``at``, and the fields of its kind
    (docs/operations.md lists them). Built by the controller only."""

    model_config = ConfigDict(extra="allow", frozen=True, allow_inf_nan=False)

    seq: Count = 0
    kind: Annotated[str, Field(max_length=64)]
    at: Wall


class RoleRules(Wire):
    min_replicas: int = Field(ge=1, le=100_000)
    n_init_replicas: int = Field(ge=1, le=100_000)
    join_timeout_s: float = Field(ge=0, le=3600)


class MemberStatus(Wire):
    replica_id: ReplicaId
    role: RoleName
    name: Name
    ranks: int = Field(ge=1, le=65536)
    tp: int = Field(1, ge=1, le=65536)
    """Its tensor-parallel degree (with ``ranks``, its layout)."""
    address: Address
    capabilities: Annotated[dict[Key, Scalar], Field(max_length=64)]
    registered_at: Wall
    step: Count
    state_root: Annotated[str, Field(max_length=4096)] = ""
    root_id: Annotated[str, Field(max_length=64)] = ""
    last_request_id: Annotated[str, Field(max_length=64)] | None
    last_round: Count | None
    active_at: Wall | None
    seconds_since_heartbeat: float
    suspect: bool
    commands_pending: Count


class Rollback(Wire):
    """The job's step went back: no live replica and no checkpoint held it any more."""

    quorum_id: Count
    """The quorum that rolled back: a state committed in an older one past ``to_step``
    is of the abandoned branch."""
    from_step: Count
    to_step: Count
    at: Wall
    batches: Count | None = None
    """RL: the trained batches the lineage lost (None: a training job, no ledger)."""
    prompts: Count | None = None
    """RL: the prompts of those batches, issued again."""


class RoleStatus(Wire):
    quorum_id: Count
    round: Count
    step: Count
    force_bump: bool
    rollbacks: Annotated[list[Rollback], Field(max_length=64)] = []
    """The role's explicit rollbacks, oldest first (the last 64)."""
    unproven_step: Count = 0
    """The newest step held by a replica evicted since the last quorum without proof
    that its process is gone (it may come back with it: a round behind the role's
    step waits for it)."""
    config: RoleRules
    pending: Ids
    """Replicas waiting for the next quorum."""
    quorum: Quorum | None
    replicas: Annotated[list[MemberStatus], Many]
    desired: int | None = Field(ge=0, le=100_000)


class Checkpoints(Wire):
    latest: CheckpointRecord | None
    committed: Annotated[list[CheckpointRecord], Field(max_length=100)]


# -- the RL ledger --------------------------------------------------------------


class PromptCounts(Wire):
    issued: Count
    queued: Count
    leased: Count
    done: Count
    trained: Count
    dropped: Count = 0
    """Prompts retired untrained: their rollout could not be scored (``reward_error``)."""


class RolloutCounts(Wire):
    accepted: Count
    pending: Count
    batched: Count
    trained: Count
    discarded: Annotated[dict[Key, Count], Field(max_length=1000)]
    duplicates_dropped: Count
    unleased_refused: Count = 0
    """Rollouts submitted under a lease that never held their prompt (refused)."""


class LeaseCounts(Wire):
    open: Count
    issued: Count
    expired: Count


class BatchRecord(Wire):
    """One trained batch (the ledger's history)."""

    batch: Count
    step: Count
    reward: float
    exact_match: float
    reward_avg: float
    exact_match_avg: float
    staleness: SignedInt
    at: Wall
    tokens_per_s: Annotated[float, Field(ge=0, le=1e15)] | None = None
    """Completion tokens trained per wall second: this batch's tokens over the time since
    the batch before it was trained (the job's throughput, generation included)."""
    metrics: BatchMetrics | None = None
    """What the policy replica that acknowledged the batch measured on it."""


class SyncRecord(Wire):
    seq: Count
    mesh_id: Count
    members: Ids
    store: Address
    """The source's rendezvous address (the source is ``members[0]``)."""
    ordered_at: Wall
    done: Annotated[dict[ReplicaId, SignedInt], Many]
    source_role: Literal["policy", "rollout"] = "policy"
    """Who sends: the policy leader, or a rollout peer relaying the version it holds."""


class WeightsStatus(Wire):
    want_version: Count
    synced_version: Count
    mesh_id: Count
    sync_in_flight: SyncRecord | None
    versions: Annotated[dict[ReplicaId, SignedInt], Many]
    """Weights version each rollout replica last declared."""


class ReplayCounts(Wire):
    """The replay memory (``rl.transport.replay``), its uses counted apart from the
    fresh rollouts' accounting."""

    kind: Annotated[str, Field(max_length=16)]
    """``memory`` or ``redis``."""
    held: Count | None = None
    """Entries held (a memory replay; a Redis one is counted on its server)."""
    unwritten: Count = 0
    """Redis: trained rollouts not yet written to the server (kept until they are)."""
    added: Count
    evicted: Count
    batched: Count
    """Replayed uses in frozen batches not yet trained."""
    replayed: Count
    """Replayed uses in trained batches (in the lineage)."""
    lost: Count
    """Entries whose payload could not be read (their batches were drawn again)."""
    unavailable: Count
    """Batches frozen from fresh rollouts only: the replay's server did not answer."""


class EpisodeCounts(Wire):
    """Multi-turn episode progress (:mod:`phalanx.protocol.episode`): what the
    controller holds now, and what happened to the reports."""

    held: Count
    """Prompts in flight with progress kept."""
    held_bytes: Count
    """Bytes of the progress kept (``rl.loop.episode_bytes`` caps it)."""
    reports: Count
    """Reports kept (each replaces its prompt's previous one)."""
    unleased: Count
    """Reports refused: their prompt was not in the caller's live lease."""
    over_cap: Count
    """Reports not kept: the cap was reached."""
    resumed: Count
    """Prompts dispatched again with the progress kept for them (``PromptRef.resume``)."""
    turns_carried: Count
    """Completed turns those dispatches carried (not generated again)."""


class LedgerStatus(Wire):
    ok: bool
    """The ledger balances: every prompt and every rollout is accounted for."""
    prompts: PromptCounts
    rollouts: RolloutCounts
    leases: LeaseCounts
    policy_step: Count
    next_batch: Count
    run: Annotated[str, Field(max_length=64)]
    leased_by: Annotated[dict[ReplicaId, Count], Many]
    finished: bool
    """The job's last step is durable (a committed save holds it)."""
    final_step: Count | None = None
    """The job's last step, once a commit decided it (finished once it is durable)."""
    last: BatchRecord | None
    history: Annotated[list[BatchRecord], Field(max_length=10_000)]
    weights: WeightsStatus
    payloads: Annotated[dict[Key, Count], Field(max_length=64)] = {}
    """With a rollout store outside the controller: ``unswept``, the payload drops
    journaled and not yet made by the collector."""
    replay: ReplayCounts | None = None
    """With ``rl.transport.replay``: the replay memory's counts."""
    episodes: EpisodeCounts | None = None
    """Multi-turn episode progress kept and carried to new holders."""


# -- the overview ---------------------------------------------------------------


class JobRL(Wire):
    batch: Count | None = None
    reward: float | None = None
    reward_avg: float | None = None
    exact_match: float | None = None
    exact_match_avg: float | None = None
    staleness: SignedInt | None = None
    tokens_per_s: float | None = None
    """Completion tokens trained per wall second over the latest batch."""
    train_tokens_per_s: float | None = None
    """The acknowledging policy replica's tokens through forward and backward per second."""
    mismatch_kl: float | None = None
    """The acknowledging policy replica's off-policy metrics of the latest batch
    (:class:`~phalanx.protocol.rl.BatchMetrics`): KL(behaviour || trainer), k3."""
    ess: float | None = None
    """Effective sample size fraction of the importance weights trainer/behaviour."""
    is_clip_frac: float | None = None
    """Fraction of tokens whose importance weight was truncated."""
    is_mask_frac: float | None = None
    """Fraction of tokens masked out of the loss."""
    staleness_tokens: Annotated[dict[Staleness, Count], Field(max_length=4096)] | None = None
    """Completion tokens per staleness (trained step - behaviour version)."""
    policy_idle: Annotated[float, Field(ge=0, le=1)] | None = None
    """The fraction of its time that replica waited for rollouts since its previous ack."""


class JobDiLoCo(Wire):
    outer_step: Count
    inner_step: Count
    sync_every: Count


class JobOverview(Wire):
    step: Count
    quorum_id: Count
    steps_per_s: float
    rl: JobRL | None = None
    diloco: JobDiLoCo | None = None


class ReplicaOverview(Wire):
    replica_id: ReplicaId
    name: Name
    incarnation: Annotated[str, Field(max_length=64)]
    state: Annotated[str, Field(max_length=16)]
    """``joining``, ``healing``, ``active`` or ``suspected``."""
    uptime_s: float | None
    weights_version: SignedInt | None
    heartbeat_age_s: float
    address: Address
    step: Count
    loss: float | None
    inner_step: Count | None
    commands_pending: Count


class Evicted(Wire):
    replica_id: ReplicaId
    at: Wall
    detector: Annotated[str, Field(max_length=32)]
    reason: Annotated[str, Field(max_length=2000)]
    state: Annotated[str, Field(max_length=16)] = "evicted"


class RoleOverview(Wire):
    forms_quorums: bool
    """False for RL rollout replicas: their step and quorum id mean nothing."""
    step: Count
    quorum_id: Count
    quorum_size: Count
    steps_per_s: float
    desired: int | None = Field(ge=0, le=100_000)
    replicas: Annotated[list[ReplicaOverview], Many]
    evicted: Annotated[list[Evicted], Field(max_length=100)]


class LedgerOverview(Wire):
    ok: bool
    prompts_issued: Count
    prompts_queued: Count
    prompts_leased: Count
    prompts_done: Count
    prompts_trained: Count
    rollouts_pending: Count
    rollouts_batched: Count
    rollouts_trained: Count
    rollouts_discarded: Annotated[dict[Key, Count], Field(max_length=1000)]
    duplicates_dropped: Count
    unleased_refused: Count = 0
    episode_reports: Count = 0
    """Episode progress reports kept (``rl.episodes.reports``)."""
    episodes_resumed: Count = 0
    """Prompts dispatched again with their episodes' progress (``rl.episodes.resumed``)."""
    episode_turns_carried: Count = 0
    episode_bytes: Count = 0
    """Bytes of episode progress held now."""
    weights_version: Count


class Actions(Wire):
    checkpoint: bool
    scale: bool


Point = tuple[float, float]


class Overview(Wire):
    job: JobOverview
    roles: Annotated[dict[RoleName, RoleOverview], Field(max_length=64)]
    ledger: LedgerOverview | None
    series: Annotated[
        dict[Key, Annotated[list[Point], Field(max_length=10_000)]], Field(max_length=8)
    ]
    timeline: Annotated[list[Event], Field(max_length=1000)]
    checkpoints: Annotated[list[CheckpointRecord], Field(max_length=100)]
    actions: Actions


class JournalHealth(Wire):
    """Where the controller journals, and whether it can now (``controller.journal``).
    While it cannot, every request that needs a journal write is answered 503."""

    kind: Literal["sqlite", "etcd"]
    where: Annotated[str, Field(max_length=4096)]
    """The journal file, or the etcd URL and the job's key prefix."""
    healthy: bool
    """False while a write failed and is being retried, or once deposed."""
    error: Text = ""
    """The last failure, one line ('' if none yet); kept after the journal recovers."""
    unavailable_since: Wall | None = None
    unjournaled: Count = 0
    """Changes held in memory, not yet journaled (none of them acknowledged)."""
    term: Count | None = None
    """The etcd leader's term: 1 for the job's first controller, one more per takeover."""


class StandbyInfo(Wire):
    url: Annotated[str, Field(max_length=2000)]
    since: Wall
    """When it started following the job."""


class Controllers(Wire):
    """The job's controllers on an etcd journal: who leads, since when, how many
    takeovers so far, and the standbys that would take over."""

    leader: Annotated[str, Field(max_length=2000)]
    """The URL of the leader (the controller that answered)."""
    since: Wall
    """When it took office."""
    term: Count
    failovers: Count
    """Takeovers so far: ``term - 1``."""
    standbys: Annotated[list[StandbyInfo], Field(max_length=64)] = []


class Status(Reply):
    job_id: JobId
    roles: Annotated[dict[RoleName, RoleStatus], Field(max_length=64)]
    events: Annotated[list[Event], Field(max_length=1000)]
    checkpoints: Checkpoints
    rl: LedgerStatus | None = None
    overview: Overview
    journal: JournalHealth | None = None
    """The journal's health (set by the service; None from the bare core)."""
    controllers: Controllers | None = None
    """The leader and its standbys (an etcd journal; None with SQLite)."""

    def role_step(self, role: str) -> int:
        r = self.roles.get(role)
        return r.step if r is not None else 0


def as_json(model: BaseModel) -> dict[str, Any]:
    """A status as plain JSON data (``phalanx status --json`` prints it)."""
    return model.model_dump(mode="json")

"""The RL ledger's messages: prompt leases, rollouts, training batches, weight syncs.

A rollout travels in two parts (DESIGN.md, "three planes"):

- its **summary** (id, weights version, mean reward, exact match) goes to the
  controller's ledger, which accounts for every prompt and rollout;
- its **payload** (:class:`RolloutPayload`: the completions' token ids,
  log-probs and rewards) goes to the job's rollout store. With the default
  store, ``controller``, the payload rides in the same submission
  (:attr:`RolloutIn.completions`) and the controller keeps it in its payload
  log, not in its journal; with a store outside the controller (Redis,
  storage) the rollout replica puts the payload there first and submits only
  the :attr:`RolloutIn.ref` it got back.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Annotated, Literal

from pydantic import Field, model_validator

from phalanx.protocol.base import (
    MAX_INT,
    Address,
    Count,
    ReplicaId,
    Reply,
    Seq,
    Text,
    Version,
    WaitS,
    Wall,
    Wire,
)
from phalanx.protocol.episode import EpisodeProgress
from phalanx.protocol.tokens import (
    MAX_GROUP,
    MAX_TOKENS,
    LeaseId,
    LogProbs,
    PayloadRef,
    RolloutId,
    TokenIds,
    TokenMask,
)

SignedInt = Annotated[int, Field(ge=-MAX_INT, le=MAX_INT)]
Staleness = Annotated[str, Field(min_length=1, max_length=20, pattern=r"^-?[0-9]+$")]
"""A staleness in versions, as a JSON object key: decimal text."""


def parse_rollout_id(rollout_id: str) -> tuple[int, int]:
    """``p<prompt>.<attempt>`` -> (prompt, attempt). ValueError if not canonical."""
    try:
        p, a = rollout_id.removeprefix("p").split(".")
        # Canonical only: int() also takes " 1", "01", "1_0" and "+1", and a second
        # spelling of one prompt attempt would be recorded under a key of its own.
        if rollout_id != f"p{int(p)}.{int(a)}" or int(p) < 0 or int(a) < 0:
            raise ValueError
        return int(p), int(a)
    except ValueError:
        raise ValueError(
            f"rollout_id must look like p<prompt>.<attempt> as the lease gave it: got "
            f"{rollout_id!r}."
        ) from None


def rollout_id(prompt: int, attempt: int) -> str:
    return f"p{prompt}.{attempt}"


# -- payloads ---------------------------------------------------------------


class Completion(Wire):
    prompt_ids: TokenIds
    token_ids: TokenIds
    logprobs: LogProbs
    """One behaviour log-prob per token of ``token_ids``."""
    finished: bool
    """Ended with EOS (False: cut off at ``max_new_tokens``)."""
    reward: float
    versions: Annotated[list[Count], Field(max_length=MAX_TOKENS)] = []
    """The behaviour version of each token of ``token_ids`` (non-decreasing: a weight
    update landed during generation), or empty: every token is at the rollout's
    ``version``."""
    mask: TokenMask = []
    """A multi-turn episode (``[rl.env]``): 1 for each of ``token_ids`` the model
    generated, 0 for the environment's (tool results, turn markers), which are
    context but not trained on (their ``logprobs`` are 0). Empty: every token is the
    model's."""

    @model_validator(mode="after")
    def _versions(self) -> Completion:
        v = self.versions
        if v and len(v) != len(self.token_ids):
            raise ValueError(
                f"completion versions must be empty or one per token: got {len(v)} versions "
                f"for {len(self.token_ids)} tokens"
            )
        if self.mask and len(self.mask) != len(self.token_ids):
            raise ValueError(
                f"completion mask must be empty or one 0/1 per token: got {len(self.mask)} "
                f"for {len(self.token_ids)} tokens"
            )
        if any(b < a for a, b in pairwise(v)):
            raise ValueError(
                f"completion versions must be non-decreasing (weights only move forward "
                f"during a generation): got {v[:16]}"
            )
        return self


class RolloutPayload(Wire):
    """What a rollout store keeps: the group's completions, by rollout id."""

    rollout_id: RolloutId
    version: Version
    completions: Annotated[list[Completion], Field(min_length=1, max_length=MAX_GROUP)]


class RolloutIn(Wire):
    """One rollout submitted against a prompt lease: its summary, and its payload
    (``completions``) or where the payload was put (``ref``), never both."""

    rollout_id: RolloutId
    version: Count
    """The weights version that generated it: the oldest of its tokens' when a weight
    update landed during generation (:attr:`Completion.versions`), so the ledger's
    staleness check measures the oldest token."""
    reward: float
    """Mean reward of the group."""
    exact_match: float = Field(ge=0, le=1)
    """Fraction of the group that is exactly right."""
    completions: Annotated[list[Completion], Field(max_length=MAX_GROUP)] = []
    """The payload, when the controller stores it (``rl.transport.rollouts = "controller"``)."""
    ref: PayloadRef | None = None
    """The payload's ref in the job's rollout store, when it is outside the controller."""
    discard: str = Field("", max_length=300)
    """Why this rollout cannot be trained (a reward function raised or timed out), with
    neither completions nor ref: the ledger discards it on arrival as ``reward_error``
    and retires its prompt (counted as ``dropped``): the same prompt would fail again."""

    @model_validator(mode="after")
    def _payload_or_ref(self) -> RolloutIn:
        if self.discard:
            if self.completions or self.ref is not None:
                raise ValueError(
                    "a rollout submitted as discarded must carry neither completions nor a "
                    f"ref: got {len(self.completions)} completions and ref {self.ref!r}"
                )
            return self
        oldest = min((c.versions[0] for c in self.completions if c.versions), default=None)
        if oldest is not None and oldest < self.version:
            raise ValueError(
                f"a rollout's version must be the oldest of its tokens': got version "
                f"{self.version} with a token of version {oldest}"
            )
        if bool(self.completions) == (self.ref is not None):
            raise ValueError(
                "a rollout must carry its completions or the ref of its stored payload, not "
                f"both and not neither: got {len(self.completions)} completions and ref "
                f"{self.ref!r}"
            )
        return self

    def payload(self) -> RolloutPayload:
        """The payload part (already validated with this model: not again)."""
        return RolloutPayload.model_construct(
            rollout_id=self.rollout_id, version=self.version, completions=self.completions
        )


# -- prompt leases (rollout replicas) ----------------------------------------


class SyncOrder(Wire):
    """A weight-sync order from the controller, as one member sees it."""

    seq: Seq
    mesh_id: Count
    """Changes whenever the set of members (or the leader) changes: rebuild the group."""
    members: Annotated[tuple[ReplicaId, ...], Field(min_length=2, max_length=100_000)]
    """Replica ids: the source first (the policy leader), then the receivers."""
    rank: int = Field(ge=0, le=100_000)
    """This member's position in ``members`` (0: the source)."""
    store: Address
    """Rendezvous address (``host:port``) of the source's store."""
    ordered_at: Wall = 0.0
    """When the controller ordered it (wall clock)."""
    published_at: Wall = 0.0
    """When the version it sends was committed and wanted by the rollout replicas (wall
    clock; the order's own time when not known): a receiver measures from it how long
    the new weights took to reach its generation (``sync_effect_s``). An order may
    come long after the publish when the sync waits for generation to end."""


class PromptRef(Wire):
    index: Count
    rollout_id: RolloutId
    resume: EpisodeProgress | None = None
    """A multi-turn prompt dispatched again after its replica was lost: the episodes'
    turns it reported (:mod:`phalanx.protocol.episode`), replayed rather than
    generated again. None: start from the prompt."""


class PromptLease(Wire):
    lease_id: LeaseId
    deadline_s: float = Field(ge=0, le=86400)
    """Seconds the prompts are held; unsubmitted ones are dispatched again after."""
    prompts: Annotated[list[PromptRef], Field(min_length=1, max_length=MAX_GROUP)]


class PromptLeaseReq(Wire):
    replica_id: ReplicaId
    version: Version
    """Weights version the replica holds; -1 before it has any."""
    max_prompts: int = Field(4, ge=1, le=MAX_GROUP)
    wait_s: WaitS = 0.0


class PromptLeaseReply(Reply):
    lease: PromptLease | None = None
    sync: SyncOrder | None = None
    """A weight sync this replica must join before it generates."""
    init_weights: bool
    """Nothing was trained yet: a replica without weights builds version 0 itself."""
    finished: bool
    policy_step: Count
    min_version: SignedInt
    """Oldest weights version whose rollouts may still train."""


class SubmitReq(Wire):
    replica_id: ReplicaId
    lease_id: LeaseId
    rollouts: Annotated[list[RolloutIn], Field(min_length=1, max_length=MAX_GROUP)]


class SubmitReply(Reply):
    """Each rollout id is recorded once: copies are dropped (``duplicate``), rollouts
    made with too old weights are discarded (``stale``), rollouts of a prompt the
    submitting lease never held (never issued, a made-up lease id, another replica's
    lease) are refused (``unleased``), and those the replica could not score are
    recorded as ``discarded``."""

    accepted: Annotated[list[RolloutId], Field(max_length=MAX_GROUP)]
    duplicate: Annotated[list[RolloutId], Field(max_length=MAX_GROUP)]
    stale: Annotated[list[RolloutId], Field(max_length=MAX_GROUP)]
    unleased: Annotated[list[RolloutId], Field(max_length=MAX_GROUP)] = []
    discarded: Annotated[list[RolloutId], Field(max_length=MAX_GROUP)] = []
    """Submitted as discarded (``RolloutIn.discard``): recorded, its prompt retired."""


# -- training batches (policy replicas) --------------------------------------


class BatchRollout(Wire):
    rollout_id: RolloutId
    prompt: Count
    version: Count
    reward: float
    exact_match: float = Field(ge=0, le=1)
    ref: PayloadRef | None = None
    """Where the payload is, when the rollout store is outside the controller."""
    completions: Annotated[list[Completion], Field(max_length=MAX_GROUP)] = []
    """The payload, when the controller stores it."""
    replayed: bool = False
    """Drawn from the replay memory (``rl.loop.replay_ratio``): a rollout trained
    before, under its original id. Its payload comes like a fresh one's (completions
    or ref) with a ``memory`` replay, or neither: read it by id from the Redis replay."""

    def payload(self) -> RolloutPayload:
        """The payload that came with the batch (when the controller stores payloads)."""
        return RolloutPayload.model_construct(
            rollout_id=self.rollout_id, version=self.version, completions=self.completions
        )


class Batch(Wire):
    """The rollouts one policy step trains on: frozen at the first ask, the same for
    every replica of the quorum and for a retried step."""

    index: Count
    step: Count
    frozen_at: Wall
    reward: float
    exact_match: float = Field(ge=0, le=1)
    staleness: SignedInt
    """The batch's step minus the oldest weights version in it."""
    rollouts: Annotated[list[BatchRollout], Field(min_length=1, max_length=MAX_GROUP)]


class BatchLeaseReq(Wire):
    replica_id: ReplicaId
    step: Count
    """The replica's committed step count: the batch asked for is the one it trains next."""
    wait_s: WaitS = 0.0
    durable: Count | None = None
    """Steps this replica knows to be in a committed checkpoint. The ask acknowledges
    ``min(step, durable)`` (an ack lost to a crash); None: ``step`` itself (a replica
    without a checkpointer: its memory is all there is)."""
    batch: Count | None = None
    """A DiLoCo slot (docs/architecture.md, RL over DiLoCo): the batch index it asks
    for, its own; ``step`` is then the version its θ_global holds. None: the batch of
    ``step``."""


class BatchLeaseReply(Reply):
    batch: Batch | None = None
    sync: SyncOrder | None = None
    finished: bool
    """The job's last step is durable: every policy replica leaves."""
    final_step: Count | None = None
    """The job's last step, once the ledger decided it (its last batch, or the reward
    target reached, as of a commit): a replica at it trains no more, and waits for a
    save to hold it (``finished``)."""


Rate = Annotated[float, Field(ge=0, le=1e15)]


class BatchMetrics(Wire):
    """What the acknowledging policy replica measured on the batch it trained last."""

    tokens: Count | None = None
    """Completion tokens of the batch (all its rollouts)."""
    train_tokens_per_s: Rate | None = None
    """Tokens (prompt and completion) through the replica's forward and backward, per
    second of its compute."""
    mfu: Annotated[float, Field(ge=0, le=10)] | None = None
    """Model FLOPs utilisation of that compute (6 N FLOPs per token) against the
    device's peak; None where the peak is not known."""
    entropy: Rate | None = None
    """Mean per-token entropy of the policy on the replica's share of the batch."""
    kl_behaviour: Annotated[float, Field(ge=-1e6, le=1e6)] | None = None
    """k3 estimate of KL(behaviour || policy) over the share (staleness made visible)."""
    kl_ref: Annotated[float, Field(ge=-1e6, le=1e6)] | None = None
    """k3 estimate of KL(policy || reference), with ``grpo.kl_coef > 0``."""
    clip_frac: Annotated[float, Field(ge=0, le=1)] | None = None
    mismatch_kl: Annotated[float, Field(ge=-1e6, le=1e6)] | None = None
    """k3 estimate of KL(behaviour || trainer) per token at the step's start
    (:mod:`phalanx.rl.corrections`)."""
    ess: Annotated[float, Field(ge=0, le=1)] | None = None
    """Effective sample size fraction of the importance weights trainer/behaviour."""
    is_clip_frac: Annotated[float, Field(ge=0, le=1)] | None = None
    """Fraction of tokens whose importance weight was truncated (``grpo.correction``
    decoupled or tis_*)."""
    is_mask_frac: Annotated[float, Field(ge=0, le=1)] | None = None
    """Fraction of tokens masked out of the loss (``grpo.correction`` mis_*)."""
    staleness_tokens: Annotated[dict[Staleness, Count], Field(max_length=MAX_GROUP)] | None = None
    """Completion tokens per staleness (trained step - the token's behaviour version), the
    staleness as decimal text: JSON keys are text, and the wire is strict."""
    idle: Annotated[float, Field(ge=0, le=1)] | None = None
    """Fraction of the replica's wall time since its previous ack spent waiting for
    rollouts (its batch lease long-poll): near 1, the policy is starved
    (:mod:`phalanx.rl.idle`)."""
    peak_mem_mb: Rate | None = None
    """Peak memory of the replica so far (CUDA allocator peak, else peak RSS), MiB."""


class BatchAckReq(Wire):
    replica_id: ReplicaId
    step: Seq
    """Committed step count after the commit: weights may sync from it."""
    metrics: BatchMetrics | None = None
    durable: Count | None = None
    """Steps in a committed checkpoint: the ack drops the batches of
    ``min(step, durable)``; None: of ``step`` (no checkpointer: memory is all there is)."""


class BatchAckReply(Reply):
    sync: SyncOrder | None = None
    finished: bool
    final_step: Count | None = None
    """As in :class:`BatchLeaseReply`."""


class LostRollout(Wire):
    rollout_id: RolloutId
    reason: Literal["payload_missing", "payload_corrupt"]


class LostReq(Wire):
    """A policy replica could not read these rollouts' payloads from the store: the
    ledger discards them (counted under the reason) and dispatches their prompts
    again; their batch, if not yet trained, is frozen again without them."""

    replica_id: ReplicaId
    rollouts: Annotated[list[LostRollout], Field(min_length=1, max_length=MAX_GROUP)]


class LostReply(Reply):
    discarded: Annotated[list[RolloutId], Field(max_length=MAX_GROUP)]
    reopened: Annotated[list[Count], Field(max_length=MAX_GROUP)]
    """Batches unfrozen: the next ask for their step freezes a new one."""


class SyncDoneReq(Wire):
    replica_id: ReplicaId
    seq: Seq
    version: Version
    ok: bool
    error: Text = ""


class SyncDoneReply(Reply):
    synced_version: Count


class SyncPollReq(Wire):
    """A rollout replica that takes weight updates in flight asks, between two chunks
    of a generation, whether a sync order names it (answered at once: no long-poll)."""

    replica_id: ReplicaId
    version: Version
    """The weights version it generates with."""


class SyncPollReply(Reply):
    sync: SyncOrder | None = None
    """The sync order it must join now, if any."""

"""The ``[rl.loop]`` section of an RL job (prompt leases, the rollout ledger, weight
sync and staleness) and the rules that tie it to the other sections, checked at
load: each one a one-line error that names the setting and its fix."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from phalanx.config.rl import GRPOSection, TransportSection


class LoopSection(BaseModel):
    """The elastic loop of an RL job run by ``phalanx run``: prompt leases, the rollout
    ledger and weight sync. Versions count policy optimizer steps (commits), so with
    ``grpo.inner_epochs = 2`` a rollout batch spans two versions."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    prompts_per_lease: int = Field(4, ge=1, le=1 << 16)
    """Prompts a rollout replica leases at a time (each yields ``group_size`` completions)."""
    lease_s: float = Field(30.0, gt=0, le=86400)
    """Deadline of a prompt lease: a lease not submitted by then is dispatched again."""
    sync_every: int = Field(2, ge=1, le=1 << 20)
    """Policy commits between weight syncs to the rollout replicas."""
    max_staleness: int = Field(4, ge=0, le=1 << 20)
    """A rollout made with weights more than this many versions older than the batch
    it would train in is discarded (reason ``stale``) and its prompt dispatched again."""
    max_ahead: int = Field(2, ge=1, le=1024)
    """Rollout batches that may be leased or waiting ahead of the policy (backpressure:
    generating further ahead would only make stale rollouts)."""
    target_exact_match: float | None = Field(0.9, gt=0, le=1)
    """Stop once the trailing mean exact match of trained batches reaches this (None: run
    all ``grpo.steps`` batches)."""
    target_reward: float | None = Field(None, gt=0, le=1e9)
    """Also stop once the trailing mean reward reaches this (None: not a stop condition)."""
    window: int = Field(10, ge=1, le=10_000)
    """Batches in the trailing means."""
    gen_delay_s: float = Field(0.0, ge=0, le=3600)
    """Extra seconds per generated prompt on rollout replicas: a stand-in for a bigger
    model, for demos and failure tests (a lease is then held long enough to be hit)."""
    chunk_delay_s: float = Field(0.0, ge=0, le=3600)
    """Extra seconds at each point of a generation where a weight update may land (every
    ``rl.engine.chunk`` tokens, engines with in-flight updates): a stand-in for a slower
    engine, for tests and demos of syncs that land mid-generation."""
    sync_timeout_s: float = Field(2.0, gt=0, le=3600)
    """Time limit of one weight sync (rendezvous and broadcast). Idle members join at
    once; a generating one that takes updates in flight joins at its next chunk boundary,
    so this must cover one chunk's time. A member that died since the order makes the
    others wait this long before the sync is ordered again without it."""
    episode_bytes: int = Field(256 << 20, ge=0, le=1 << 40)
    """Most bytes of multi-turn episode progress (``POST /v1/rl/episodes``) the
    controller holds at once, summed over the prompts in flight (each report's JSON, in
    its memory and its payload log). A report that would pass it is not kept (the
    reply's ``over_cap``): its episode goes on, and a replica that takes the prompt
    over resumes from the last report kept, or from the prompt. 0: keep none."""
    history: int = Field(2000, ge=10, le=1_000_000)
    """Trained batches whose metrics the controller keeps for status and charts."""
    replay_ratio: float = Field(0.0, ge=0, lt=1)
    """Fraction of each batch's rollouts drawn from the replay memory
    (``rl.transport.replay``); the rest are fresh. The ledger draws
    ``round(replay_ratio * prompts_per_step)`` of them when it freezes the batch,
    seeded by (job seed, batch index), so every replica and every retry trains the
    same batch. 0: fresh rollouts only (a configured replay is still filled)."""


def check_loop(loop: LoopSection, grpo: GRPOSection, transport: TransportSection) -> None:
    """Raise ValueError (one line) where ``[rl.loop]`` does not fit the job's other
    sections."""
    if loop.replay_ratio > 0 and transport.replay is None:
        raise ValueError(
            "rl.loop.replay_ratio needs rl.transport.replay ('memory' or "
            "redis://host:port/db): got none. Set rl.transport.replay, or "
            "rl.loop.replay_ratio = 0."
        )
    if loop.sync_every > loop.max_staleness + 1:
        raise ValueError(
            f"loop.sync_every must be <= loop.max_staleness + 1: got sync_every="
            f"{loop.sync_every}, max_staleness={loop.max_staleness}. Between two "
            f"syncs every rollout would turn stale; sync more often or allow more staleness."
        )
    check_ahead(loop, grpo)


def check_ahead(loop: LoopSection, grpo: GRPOSection) -> None:
    """What asynchronous generation needs of ``max_staleness``.

    Generation ahead of the policy (``max_ahead > 1``) leases rollouts for batches
    up to ``max_ahead - 1`` past the next one. While the policy trains, the newest
    weights a replica can hold are those the batch in training started with, so
    the furthest batch's rollouts are ``max_ahead x inner_epochs`` versions old when
    it trains: with less staleness allowed they are discarded as stale whenever
    generation keeps up (a benchmark run with one batch more ahead than this
    discarded 216 of 696 rollouts). ``max_ahead = 1`` is always consistent: the
    controller leases only to replicas whose weights the next batch accepts."""
    need = loop.max_ahead * grpo.inner_epochs
    if loop.max_ahead > 1 and loop.max_staleness < need:
        fit = max(1, loop.max_staleness // grpo.inner_epochs)
        raise ValueError(
            f"rl.loop.max_staleness must be >= rl.loop.max_ahead x rl.grpo.inner_epochs "
            f"= {need} when rl.loop.max_ahead > 1 (generation ahead of the policy): got "
            f"{loop.max_staleness}. Rollouts for the furthest batch ahead are that many "
            f"versions old when it trains, and are discarded as stale; set "
            f"rl.loop.max_staleness = {need}, or rl.loop.max_ahead = {fit}."
        )

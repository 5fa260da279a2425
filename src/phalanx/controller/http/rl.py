"""RL ledger routes: prompt leases, rollout submissions, episode progress, batch
leases and acks, weight-sync reports, lost payloads. The core builds the replies
(:mod:`phalanx.controller.core.rl`); the routes hold the long-polls."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from phalanx.controller.http.base import Api, Route
from phalanx.protocol.episode import EpisodeProgressReply, EpisodeProgressReq
from phalanx.protocol.rl import (
    BatchAckReply,
    BatchAckReq,
    BatchLeaseReply,
    BatchLeaseReq,
    LostReply,
    LostReq,
    PromptLeaseReply,
    PromptLeaseReq,
    SubmitReply,
    SubmitReq,
    SyncDoneReply,
    SyncDoneReq,
    SyncPollReply,
    SyncPollReq,
)

R = TypeVar("R", PromptLeaseReply, BatchLeaseReply)


async def _long_poll(
    api: Api, rid: str, wait_s: float, call: Callable[[], R], news: Callable[[R], bool]
) -> R:
    """Call ``call`` until its reply holds something the replica acts on at once (a
    lease or batch, a sync order, the job's end, or ``news``), or ``wait_s`` passes."""
    deadline = time.monotonic() + wait_s
    out = call()
    while not news(out):
        left = deadline - time.monotonic()
        if left <= 0 or not await api.service.wait("ledger", rid, left):
            break
        out = call()
    return out


async def lease_prompts(api: Api, req: PromptLeaseReq) -> PromptLeaseReply:
    """Lease prompts (rollout replicas). Long-polls up to ``wait_s`` for a lease, a
    weight-sync order this replica must join, or the end of the job."""
    rl = api.state.rl

    def call() -> PromptLeaseReply:
        return api.service.apply(rl.lease_prompts, req.replica_id, req.version, req.max_prompts)

    # A replica without weights (version -1) is answered at once when it may build
    # version 0 from the config itself: it then asks again, holding version 0.
    # (Waiting here would hold every rollout replica up for wait_s at the start.)
    def news(r: PromptLeaseReply) -> bool:
        return bool(r.lease or r.sync or r.finished or (req.version < 0 and r.init_weights))

    return await _long_poll(api, req.replica_id, req.wait_s, call, news)


async def submit_rollouts(api: Api, req: SubmitReq) -> SubmitReply:
    """Submit a lease's rollouts. Each rollout id is recorded once: copies are
    dropped (``duplicate``), rollouts from too old weights are discarded (``stale``)."""
    rl = api.state.rl
    reply: SubmitReply = api.service.apply(
        rl.submit_rollouts, req.replica_id, req.lease_id, list(req.rollouts)
    )
    return reply


async def report_episodes(api: Api, req: EpisodeProgressReq) -> EpisodeProgressReply:
    """Report the episodes of a lease's prompts so far (multi-turn rollouts, after each
    completed turn). A report is kept, in place of the previous one, while its prompt is
    in the caller's live lease (``kept``), else refused (``unleased``: stop running that
    episode), or not kept past ``rl.loop.episode_bytes`` (``over_cap``). A prompt
    dispatched again carries the last report kept (``PromptRef.resume``)."""
    reply: EpisodeProgressReply = api.service.apply(
        api.state.rl.report_episodes, req.replica_id, req.lease_id, list(req.progress)
    )
    return reply


async def lease_batch(api: Api, req: BatchLeaseReq) -> BatchLeaseReply:
    """The frozen batch of rollouts for the policy step ``step`` (the same for every
    replica that asks for that step). Long-polls up to ``wait_s`` until it can be
    frozen, a sync order names this replica, or the job ends."""
    rl = api.state.rl

    def call() -> BatchLeaseReply:
        return api.service.apply(
            rl.lease_batch, req.replica_id, req.step, durable=req.durable, batch=req.batch
        )

    def news(r: BatchLeaseReply) -> bool:
        return bool(r.batch is not None or r.sync or r.finished)

    return await _long_poll(api, req.replica_id, req.wait_s, call, news)


async def ack_batch(api: Api, req: BatchAckReq) -> BatchAckReply:
    """The policy committed up to ``step`` (durable up to ``durable``). Idempotent."""
    metrics = req.metrics.model_dump(exclude_none=True) if req.metrics is not None else None
    reply: BatchAckReply = api.service.apply(
        api.state.rl.ack_batch, req.replica_id, req.step, metrics=metrics, durable=req.durable
    )
    return reply


async def lost(api: Api, req: LostReq) -> LostReply:
    """A policy replica could not read these payloads from the rollout store: they
    are discarded under the reason and their prompts dispatched again."""
    pairs = [(r.rollout_id, r.reason) for r in req.rollouts]
    reply: LostReply = api.service.apply(api.state.rl.lost_payloads, req.replica_id, pairs)
    return reply


async def sync_done(api: Api, req: SyncDoneReq) -> SyncDoneReply:
    """A mesh member finished (or failed) weight sync ``seq``."""
    rl = api.state.rl
    reply: SyncDoneReply = api.service.apply(
        rl.sync_done, req.replica_id, req.seq, req.version, req.ok, req.error
    )
    return reply


async def sync_poll(api: Api, req: SyncPollReq) -> SyncPollReply:
    """The sync order this rollout replica must join now, if any (answered at once: a
    replica that takes weight updates in flight asks between chunks of a generation)."""
    reply: SyncPollReply = api.service.apply(api.state.rl.sync_poll, req.replica_id, req.version)
    return reply


ROUTES = [
    Route("/v1/prompts/lease", lease_prompts, PromptLeaseReq, PromptLeaseReply),
    Route("/v1/rollouts/submit", submit_rollouts, SubmitReq, SubmitReply),
    Route("/v1/rl/episodes", report_episodes, EpisodeProgressReq, EpisodeProgressReply),
    Route("/v1/rollouts/lease", lease_batch, BatchLeaseReq, BatchLeaseReply),
    Route("/v1/rollouts/ack", ack_batch, BatchAckReq, BatchAckReply),
    Route("/v1/rollouts/lost", lost, LostReq, LostReply),
    Route("/v1/weights/done", sync_done, SyncDoneReq, SyncDoneReply),
    Route("/v1/weights/poll", sync_poll, SyncPollReq, SyncPollReply),
]

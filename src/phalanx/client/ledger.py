"""The replica side of the RL ledger's routes: prompt leases, rollout submission and
episode progress (rollout replicas), batch leases, acks and lost payloads (policy replicas), and the
weight-sync reports (both). A part of :class:`~phalanx.client.replica.ControllerClient`,
which inherits these: each call goes through its transport as the replica's current
incarnation (``_as_member``: re-registered once after an eviction, and retried).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from phalanx.protocol.episode import EpisodeProgress, EpisodeProgressReply, EpisodeProgressReq
from phalanx.protocol.rl import (
    BatchAckReply,
    BatchAckReq,
    BatchLeaseReply,
    BatchLeaseReq,
    BatchMetrics,
    LostReply,
    LostReq,
    LostRollout,
    PromptLeaseReply,
    PromptLeaseReq,
    RolloutIn,
    SubmitReply,
    SubmitReq,
    SyncDoneReply,
    SyncDoneReq,
    SyncOrder,
    SyncPollReply,
    SyncPollReq,
)

if TYPE_CHECKING:
    from phalanx.client.transport import Transport

T = TypeVar("T")


class LedgerCalls:
    """The RL ledger's calls of :class:`~phalanx.client.replica.ControllerClient`."""

    transport: Transport

    if TYPE_CHECKING:  # ControllerClient's own: a call as the current incarnation

        def _as_member(self, fn: Callable[[str], T]) -> T: ...

    def lease_prompts(
        self, version: int, max_prompts: int, wait_s: float = 10.0
    ) -> PromptLeaseReply:
        """Rollout replicas: lease up to ``max_prompts`` prompts while holding weights
        ``version`` (-1: none yet). Long-polls up to ``wait_s``. The reply's ``sync``
        (when set) is a weight-sync order to join *before* generating."""

        def send(rid: str) -> PromptLeaseReply:
            req = PromptLeaseReq(
                replica_id=rid, version=version, max_prompts=max_prompts, wait_s=wait_s
            )
            return self.transport.call(
                "/v1/prompts/lease", req, PromptLeaseReply, timeout=wait_s + 10
            )

        return self._as_member(send)

    def submit_rollouts(self, lease_id: str, rollouts: list[RolloutIn]) -> SubmitReply:
        """Submit a lease's rollouts (safe to retry: ids dedupe)."""

        def send(rid: str) -> SubmitReply:
            req = SubmitReq(replica_id=rid, lease_id=lease_id, rollouts=rollouts)
            return self.transport.call("/v1/rollouts/submit", req, SubmitReply)

        return self._as_member(send)

    def report_episodes(
        self, lease_id: str, progress: list[EpisodeProgress]
    ) -> EpisodeProgressReply:
        """Rollout replicas running multi-turn episodes: report each leased prompt's
        episodes so far, after each completed turn (safe to retry: a report replaces the
        previous one). A rollout id in the reply's ``unleased`` is no longer this
        replica's (its lease ended, or the prompt is done): stop running it. One in
        ``over_cap`` was not kept; go on. The progress kept comes back as
        ``PromptRef.resume`` to the replica the prompt is dispatched to next."""

        def send(rid: str) -> EpisodeProgressReply:
            req = EpisodeProgressReq(replica_id=rid, lease_id=lease_id, progress=progress)
            return self.transport.call("/v1/rl/episodes", req, EpisodeProgressReply)

        return self._as_member(send)

    def lease_batch(
        self,
        step: int,
        wait_s: float = 10.0,
        durable: int | None = None,
        batch: int | None = None,
    ) -> BatchLeaseReply:
        """Policy replicas: the rollout batch of ``step`` (the same for every replica).
        ``durable``: the steps known to be checkpointed; ``batch``: a DiLoCo slot's own
        batch index (see ``BatchLeaseReq``)."""

        def send(rid: str) -> BatchLeaseReply:
            req = BatchLeaseReq(
                replica_id=rid, step=step, wait_s=wait_s, durable=durable, batch=batch
            )
            return self.transport.call(
                "/v1/rollouts/lease", req, BatchLeaseReply, timeout=wait_s + 10
            )

        return self._as_member(send)

    def ack_batch(
        self, step: int, metrics: BatchMetrics | None = None, durable: int | None = None
    ) -> BatchAckReply:
        """Policy replicas: committed up to ``step`` (weights may sync from it); the
        batches of ``min(step, durable)`` are trained (``durable``: the steps in a
        committed checkpoint; None: all). ``metrics``: what the replica measured on its
        last batch (for the history)."""

        def send(rid: str) -> BatchAckReply:
            req = BatchAckReq(replica_id=rid, step=step, metrics=metrics, durable=durable)
            return self.transport.call("/v1/rollouts/ack", req, BatchAckReply)

        return self._as_member(send)

    def lost_payloads(self, lost: list[tuple[str, str]]) -> LostReply:
        """Policy replicas: these rollouts' payloads could not be read from the store
        (``(rollout id, "payload_missing" | "payload_corrupt")``)."""

        def send(rid: str) -> LostReply:
            rollouts = [LostRollout(rollout_id=r, reason=why) for r, why in lost]  # type: ignore[arg-type]
            return self.transport.call(
                "/v1/rollouts/lost", LostReq(replica_id=rid, rollouts=rollouts), LostReply
            )

        return self._as_member(send)

    def sync_poll(self, version: int) -> SyncOrder | None:
        """The weight-sync order that names this rollout replica now, if any (answered at
        once). For a replica that takes updates in flight, between generation chunks."""

        def send(rid: str) -> SyncPollReply:
            req = SyncPollReq(replica_id=rid, version=version)
            return self.transport.call("/v1/weights/poll", req, SyncPollReply)

        return self._as_member(send).sync

    def sync_done(self, seq: int, version: int, ok: bool, error: str = "") -> SyncDoneReply:
        """Report the end of weight sync ``seq`` (every mesh member, leader included)."""

        def send(rid: str) -> SyncDoneReply:
            req = SyncDoneReq(replica_id=rid, seq=seq, version=version, ok=ok, error=error[:1000])
            return self.transport.call("/v1/weights/done", req, SyncDoneReply)

        return self._as_member(send)

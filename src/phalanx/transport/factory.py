"""Pick each transport backend from the URL in the job's ``[rl.transport]``.

Heavy and optional imports (redis, fsspec backends) happen only for the
backend asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from phalanx.transport.base import ReplayBuffer, RolloutQueue, WeightChannel

if TYPE_CHECKING:
    from phalanx.rl.config import TransportSection


def is_redis(url: str) -> bool:
    return url.startswith(("redis://", "rediss://"))


def queue_name(job_id: str, client: Any) -> str:
    """The rollout queue's namespace: the job id and the ledger's run (from the
    controller), so that a rerun of a job never meets the previous run's ids."""
    return f"{job_id}.{client.status()['rl']['run']}"


def rollout_queue(
    t: TransportSection, name: str, consumer: str, group: str = "policy"
) -> RolloutQueue | None:
    """The job's rollout queue, or None for the controller's embedded ledger.
    ``name`` (the job id) keeps jobs sharing a Redis server apart."""
    if t.rollouts == "controller":
        return None
    if is_redis(t.rollouts):
        from phalanx.transport.redis_queue import RedisRolloutQueue

        return RedisRolloutQueue(t.rollouts, name, consumer, group=group, lease_s=t.lease_s)
    from phalanx.transport.spool import SpoolRolloutQueue

    return SpoolRolloutQueue(
        t.rollouts, consumer, name=name, lease_s=t.lease_s, keep_segments=t.keep_segments
    )


def weight_channel(
    t: TransportSection, name: str, timeout_s: float, device: torch.device | None = None
) -> WeightChannel:
    """The job's weight channel: the collective broadcast, or a published store."""
    if t.weights == "collective":
        from phalanx.transport.collective import CollectiveWeightChannel

        return CollectiveWeightChannel(timeout_s, device)
    from phalanx.transport.published import StoreWeightChannel

    if is_redis(t.weights):
        from phalanx.transport.redis_weights import RedisWeightStore

        return StoreWeightChannel(
            RedisWeightStore(t.weights, name, keep=t.keep_versions), timeout_s
        )
    from phalanx.transport.storage_weights import StorageWeightStore

    return StoreWeightChannel(StorageWeightStore(t.weights, keep=t.keep_versions), timeout_s)


def replay_buffer(t: TransportSection, name: str) -> ReplayBuffer | None:
    """The job's replay buffer, or None when none is configured."""
    if t.replay is None:
        return None
    from phalanx.transport.replay import MemoryReplayBuffer, RedisReplayBuffer

    if t.replay == "memory":
        return MemoryReplayBuffer(t.replay_size)
    return RedisReplayBuffer(t.replay, name, t.replay_size)

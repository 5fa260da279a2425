"""Pick each transport backend from the URL in the job's ``[rl.transport]``
(or, for a rollout queue outside an RL job, from a URL: :func:`open_queue`).

Heavy and optional imports (redis, fsspec backends) happen only for the
backend asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from phalanx.transport.base import ReplayBuffer, RolloutQueue, TransportError, WeightChannel

if TYPE_CHECKING:
    from phalanx.client import ControllerClient
    from phalanx.rl.config import TransportSection


def is_redis(url: str) -> bool:
    return url.startswith(("redis://", "rediss://"))


def queue_name(job_id: str, client: Any) -> str:
    """The rollout queue's namespace: the job id and the ledger's run (from the
    controller), so that a rerun of a job never meets the previous run's ids."""
    return f"{job_id}.{client.status()['rl']['run']}"


def open_queue(
    url: str,
    name: str,
    consumer: str,
    *,
    group: str = "policy",
    lease_s: float = 30.0,
    keep_segments: bool = False,
    controller: str | ControllerClient | None = None,
    storage_options: Mapping[str, Any] | None = None,
) -> RolloutQueue:
    """The rollout queue at ``url``, under the contract of
    :class:`~phalanx.transport.base.RolloutQueue`: ``controller`` (a queue held by
    the controller named by ``controller``: its URL, state dir or a client),
    ``redis://host:port/db`` or a storage URL (a spool). ``name`` keeps jobs (and
    runs) sharing a server or a bucket apart."""
    if url == "controller":
        if controller is None:
            raise TransportError(
                "the controller rollout queue must know its controller: got none. Pass "
                "controller= (its URL or state dir, or a ControllerClient)."
            )
        from phalanx.transport.controller_queue import ControllerRolloutQueue

        return ControllerRolloutQueue(controller, name, consumer, lease_s=lease_s)
    if is_redis(url):
        from phalanx.transport.redis_queue import RedisRolloutQueue

        return RedisRolloutQueue(url, name, consumer, group=group, lease_s=lease_s)
    from phalanx.transport.spool import SpoolRolloutQueue

    return SpoolRolloutQueue(
        url,
        consumer,
        name=name,
        lease_s=lease_s,
        keep_segments=keep_segments,
        storage_options=storage_options,
    )


def rollout_queue(
    t: TransportSection, name: str, consumer: str, group: str = "policy"
) -> RolloutQueue | None:
    """The RL job's rollout queue, or None when its rollouts go to the controller.

    With ``controller`` (the default) the rollout replicas submit to the RL
    ledger itself, and the ledger is the queue: a submit is the put (recorded
    once by id, refused or discarded with a reason that the submitter gets back
    at once, such as ``stale``), a step's frozen batch is the lease (shared by
    the policy quorum, and given again on a retried step), the commit's ack is
    the ack, and an expired prompt lease is the redelivery. Routing the rollouts
    through a :class:`~phalanx.transport.controller_queue.ControllerRolloutQueue`
    instead would send each one through the controller three times (put, lease
    by the policy's :class:`~phalanx.transport.ingest.Ingest`, submit), journal
    it twice, and hide the ledger's verdict from the rollout replica. That queue
    serves what is not the ledger: tools, benchmarks, and off-policy consumers
    (``open_queue("controller", ...)``)."""
    if t.rollouts == "controller":
        return None
    return open_queue(
        t.rollouts,
        name,
        consumer,
        group=group,
        lease_s=t.lease_s,
        keep_segments=t.keep_segments,
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

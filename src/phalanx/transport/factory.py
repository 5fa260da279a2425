"""Pick each transport backend from the URL in the job's ``[rl.transport]``: the
rollout store and the weight channel (the replay memory is the controller's:
:mod:`phalanx.controller.replay_writer`).

Heavy and optional imports (redis, fsspec backends) happen only for the
backend asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from phalanx.transport.base import RolloutStore, WeightChannel

if TYPE_CHECKING:
    from phalanx.config.rl import TransportSection


def is_redis(url: str) -> bool:
    return url.startswith(("redis://", "rediss://"))


def rollout_store(t: TransportSection, name: str) -> RolloutStore | None:
    """The RL job's rollout store, or None when it is the controller's own.

    With ``controller`` (the default) the rollout replicas send the completions
    with their submission, and the controller keeps them in its payload log
    (not its journal) until the rollout is trained or discarded: one round trip
    per lease, nothing to install. With ``redis://...`` or a storage URL, they
    put the payloads there and submit only the refs; the policy replicas read
    them by ref, and the controller's collector drops them when their rollouts
    are trained or discarded. ``name`` is the job's namespace
    (:func:`~phalanx.transport.base.store_name`)."""
    return None if t.rollouts == "controller" else open_store(t.rollouts, name)


def open_store(url: str, name: str) -> RolloutStore:
    """The rollout store at ``url``: ``redis://host:port/db`` or a storage URL."""
    if is_redis(url):
        from phalanx.transport.redis_store import RedisRolloutStore

        return RedisRolloutStore(url, name)
    from phalanx.transport.storage_store import StorageRolloutStore

    return StorageRolloutStore(url, name)


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

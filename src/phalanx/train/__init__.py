"""The fault-tolerant training library: per-step quorum, commit, heal, constant
global batch, and DiLoCo's outer loop. No process loop of its own (those are
in :mod:`phalanx.jobs`).

- ``base.py``         the compute callback and a step's result
- ``manager.py``      quorum per step, all-reduce, commit everywhere or nowhere, live heal
- ``ft_optimizer.py`` an optimizer wrapper that steps only when the step commits
- ``hsdp.py``         replicas of several ranks: FSDP2 inside, the FT manager across (HSDP)
- ``shards.py``       a rank's shards: local tensors, sharded gradient buckets, whole -> shard
- ``grads.py``        gradients in flat buffers, bucketed all-reduce with the commit vote
- ``heal.py``         the state a joiner receives, into a pre-faulted buffer
- ``batch.py``        a replica's share of the global batch, micro-batches
- ``snapshot.py``     a replica's whole state as one safetensors blob
- ``rng.py``          the random generators' state (heals and checkpoints carry it)
- ``orders.py``       operator commands honoured at step boundaries (drain, checkpoint)
- ``diloco.py``       DiLoCo's outer loop (H inner steps, outer optimizer, streaming fragments)
- ``diloco_sync.py``  DiLoCo's outer step over the FT group (a quorum per round)
- ``tp.py``, ``tp_state.py``  a tensor-parallel transformer and its layout-free state

Imported lazily, so that a worker that needs only one submodule (``train.tp``,
``train.diloco``) does not pay for the others."""

from typing import Any

__all__ = ["FTOptimizer", "Manager", "StepResult"]


def __getattr__(name: str) -> Any:
    if name == "FTOptimizer":
        from phalanx.train import ft_optimizer

        return ft_optimizer.FTOptimizer
    if name in __all__:
        from phalanx.train import manager

        return getattr(manager, name)
    raise AttributeError(f"module 'phalanx.train' has no attribute {name!r}")

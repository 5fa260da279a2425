"""Fault-tolerant data parallelism: per-step quorum, commit, heal, constant global batch.

Imported lazily, so that a worker that needs only one submodule (``train.tp``,
``train.diloco``) does not pay for the others."""

from typing import Any

__all__ = ["FTOptimizer", "Manager", "StepResult"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from phalanx.train import manager

        return getattr(manager, name)
    raise AttributeError(f"module 'phalanx.train' has no attribute {name!r}")

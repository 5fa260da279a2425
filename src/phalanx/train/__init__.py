"""Fault-tolerant data parallelism: per-step quorum, commit, heal, constant global batch."""

from phalanx.train.manager import FTOptimizer, Manager, StepResult

__all__ = ["FTOptimizer", "Manager", "StepResult"]

"""What the training library's pieces share: the compute callback a loop hands
the manager, and what a step returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

Compute = Callable[[list[int], float], float]
"""``compute(sample_indices, loss_scale) -> summed loss``: forward and backward on
the samples, with the summed loss multiplied by ``loss_scale`` before backward."""


@dataclass
class StepResult:
    committed: bool
    step: int
    """The committed step count after this call."""
    loss: float | None
    """Mean loss over the global batch (only when committed)."""
    participants: int
    quorum_id: int
    healed: bool = False
    error: str | None = None


@dataclass
class Held:
    """What a replica's gradients hold, unreduced, for one step: the sample
    positions accumulated so far (its share, or part of it) and their summed loss.
    A retry or a changed share computes only the positions missing from it."""

    step: int
    indices: list[int]
    loss: float


class JobFinished(RuntimeError):
    """The job committed its last step while this replica waited to join."""


class NonFiniteGradient(RuntimeError):
    """A step's gradient held a NaN or an Inf in every attempt: an exact reduction
    cannot sum it, and retrying the same samples on the same model will not help."""


class BranchAbandoned(RuntimeError):
    """This replica's state is of a branch the job rolled back (the controller refused
    its quorum request): it must restart, to resume from the checkpoint root or heal
    from a peer. The process exits (status 1) and its launcher starts it again."""

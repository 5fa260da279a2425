"""What the rest of the job tells quorum formation about a role's steps.

Quorum formation (:mod:`.quorum`) keeps the promise that the job's step never
goes back by accident, and that a replica behind a finished job stops. What
that takes from outside membership is here: which roles' steps are guarded,
what the job's last step is, and what follows a rollback (the RL ledger takes
back what it trained past the step it went back to).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phalanx.config import JobConfig
    from phalanx.controller.core.ledger import Ledger
    from phalanx.controller.core.records import RoleState


def _always(rs: RoleState) -> bool:
    return True


def _no_final(rs: RoleState) -> int | None:
    return None


def _no_ledger(rs: RoleState, from_step: int, to_step: int, wall: float) -> dict[str, Any]:
    return {}


@dataclass
class StepRules:
    guarded: Callable[[RoleState], bool] = _always
    """Whether the role's step must never go back by accident (False: its quorums only
    name a round's members, as decoupled DiLoCo's, whose state is in the object store)."""
    final_step: Callable[[RoleState], int | None] = _no_final
    """The job's last step once the job is done (a replica behind it stops)."""
    rollback: Callable[[RoleState, int, int, float], dict[str, Any]] = _no_ledger
    """Called when the role's step goes back from ``from_step`` to ``to_step``: makes
    the ledger follow, and returns the figures the ``rollback`` event carries."""
    wait_s: float = 60.0
    """``timeouts.lost_step_wait_s``: how long a round behind the role's step waits
    for a replica that holds it before the job rolls back."""


def step_rules(cfg: JobConfig, ledger: Callable[[], Ledger | None]) -> StepRules:
    """The rules of ``cfg``'s job; ``ledger`` gives its RL ledger (None: a training job)."""

    def guarded(rs: RoleState) -> bool:
        # Decoupled DiLoCo's slots ask for quorums only to learn a round's members.
        d = cfg.diloco
        return rs.name == "policy" and not (d is not None and d.mode == "objectstore")

    def final_step(rs: RoleState) -> int | None:
        # A training job's configured steps (or DiLoCo rounds); an RL job's last step
        # once its ledger holds it durable (before that, losing it is a rollback).
        led = ledger()
        if rs.name != "policy":
            return None
        if led is None:
            return cfg.job_steps
        return led.final_step if led.finished else None

    def rollback(rs: RoleState, from_step: int, to_step: int, wall: float) -> dict[str, Any]:
        led = ledger()
        if led is None or rs.name != "policy":
            return {}
        return led.rollback(from_step, to_step, wall=wall)

    return StepRules(guarded, final_step, rollback, cfg.timeouts.lost_step_wait)

"""An optimizer wrapper that steps only on commit, for loops that own the step order."""

from __future__ import annotations

from typing import Any

import torch

from phalanx.train.manager import Manager


class FTOptimizer:
    """Wraps an optimizer so that it steps only when the step commits.

    Use it where the loop owns the order instead of :meth:`Manager.train_step`::

        manager.start_quorum(); opt.zero_grad()
        ... forward/backward on manager.share() (after manager.wait_quorum()) ...
        manager.allreduce_grads(loss_sum)
        opt.step()   # calls manager.should_commit(); steps only on True
    """

    def __init__(self, manager: Manager, optimizer: torch.optim.Optimizer):
        self.manager = manager
        self.optimizer = optimizer
        self.param_groups = optimizer.param_groups

    def zero_grad(self, set_to_none: bool = False) -> None:
        # Gradients live in the manager's flat buffer: zero it, never drop it.
        self.manager.grads.zero()

    def step(self) -> bool:
        """Step the optimizer if every participant succeeded. Returns whether it did."""
        if self.manager.should_commit():
            self.optimizer.step()
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(sd)

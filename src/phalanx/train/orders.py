"""Operator commands a training replica honours at step boundaries, from the
controller's command queue (the dashboard's actions):

- ``checkpoint`` (``POST /v1/checkpoints/trigger``): names a step a little
  ahead; every replica learns it, and the quorum's rank 0 saves after
  committing that step, so the saved state is the same whoever saves;
- ``drain`` (``POST /v1/replicas/drain``): the replica leaves the job after
  its next commit; the others go on without it.

RL replicas take only ``drain`` (:mod:`phalanx.jobs.rl_policy` leaves after a
committed and acknowledged step, :mod:`phalanx.jobs.rl_rollout` between two
generation batches); a command of another kind stays pending for them.

Polled without waiting, at most once a second.
"""

from __future__ import annotations

import logging
import time

from phalanx.client import ControllerClient, ControllerError

log = logging.getLogger("phalanx.train")

KINDS = ("checkpoint", "drain")


class Orders:
    """Who calls: the replica's main loop, at each step boundary (after a committed
    step; for a rollout replica, between generation batches). Not thread-safe.
    ``kinds``: the commands this replica acts on; others are left pending."""

    def __init__(
        self, client: ControllerClient, every_s: float = 1.0, kinds: tuple[str, ...] = KINDS
    ):
        self.client, self.every_s, self.kinds = client, every_s, kinds
        self.checkpoints: set[int] = set()
        self.drain = False
        self.next_poll = 0.0

    def poll(self, step: int) -> None:
        """Take in new commands (at most every ``every_s``); ack them."""
        now = time.monotonic()
        if now < self.next_poll:
            return
        self.next_poll = now + self.every_s
        try:
            cmds = [c for c in self.client.poll_commands(wait_s=0) if c.kind in self.kinds]
            for c in cmds:
                if c.kind == "checkpoint":
                    self.checkpoints.add(_step_of(c.payload, step))
                else:
                    self.drain = True
            if cmds:
                self.client.ack([c.id for c in cmds])
        except (ControllerError, ValueError) as e:
            log.warning("could not read operator commands: %s", e)

    def checkpoint_due(self, step: int) -> bool:
        """Whether a checkpoint was ordered at ``step`` (or at a step already passed)."""
        hit = any(x <= step for x in self.checkpoints)
        self.checkpoints = {x for x in self.checkpoints if x > step}
        return hit


def _step_of(payload: dict[str, object], default: int) -> int:
    """The step a ``checkpoint`` command names (its payload is free-form JSON)."""
    step = payload.get("step", default)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"a checkpoint command's payload.step must be a step: got {step!r}")
    return step

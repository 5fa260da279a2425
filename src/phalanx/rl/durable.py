"""The policy's state through the async DCP checkpointer, and acks that wait for it.

A policy replica acknowledges a step to the ledger (the batches it covers are
trained: their payloads are dropped, their prompts done). That is safe only
once the step survives the loss of every policy replica, so the ack waits for a
committed checkpoint that holds it:

- at an ack point, rank 0 of the quorum (the policy leader; every member holds
  the same state after a commit) starts an async save (``Checkpointer.save_async``:
  the step stalls only for the copy to host memory) and training goes on;
- when that save commits, the ack is sent (polled between steps and while
  waiting for a batch);
- the other members send no ack; their batch asks tell the controller only the
  steps they know to be durable (``BatchLeaseReq.durable``).

A restarted replica resumes from the newest committed checkpoint, which is
never behind the ledger; the ledger re-offers the batches of any steps after
it. Nothing committed is lost and nothing is trained twice. Without a
checkpointer (no ``--state``), acks go at once, as the replica's memory is all
there is.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phalanx.checkpoint import Checkpointer
    from phalanx.client import ControllerClient
    from phalanx.protocol.rl import BatchAckReply, BatchMetrics
    from phalanx.train.manager import Manager

log = logging.getLogger("phalanx.rl.durable")


class DurableAcks:
    """Acks of one policy replica, each sent once a checkpoint holds its step.

    Who calls: the replica's training loop, single-threaded: :meth:`ack` at each
    ack point after the commit, :meth:`poll` between steps and while waiting for a
    batch, :meth:`close` at the end (it waits for the last save and sends its ack).
    """

    def __init__(self, client: ControllerClient, ckpt: Checkpointer | None, extra: dict[str, Any]):
        self.client, self.ckpt, self.extra = client, ckpt, extra
        self.pending: tuple[int, BatchMetrics | None] | None = None
        self.durable = 0
        """The newest step known to be in a committed checkpoint (resumed or saved)."""

    @property
    def durable_for_lease(self) -> int | None:
        """What a batch ask may acknowledge: None without a checkpointer (all of it)."""
        return None if self.ckpt is None else self.durable

    def ack(self, manager: Manager, metrics: BatchMetrics | None) -> list[BatchAckReply]:
        """An ack point: acknowledge now (no checkpointer), or, on the quorum's rank 0,
        save the state in the background and acknowledge when it commits. Returns the
        replies of the acks sent by this call (an earlier save's, if it was pending)."""
        if self.ckpt is None:
            return [self.client.ack_batch(manager.step, metrics)]
        if manager.rank != 0:
            return []
        replies = self.poll(block=True)  # one save at a time: the previous one's ack first
        try:
            self.ckpt.save_async(manager.step, manager.state_dict(), self.extra)
        except Exception as e:  # storage failed: the ack waits for the next save
            log.error("could not start the checkpoint of step %d: %s", manager.step, e)
            return replies
        self.pending = (manager.step, metrics)
        return replies

    def poll(self, block: bool = False) -> list[BatchAckReply]:
        """Send the ack of the save in flight if it committed (with ``block``: wait
        for it). A save that failed sends nothing: the next ack point saves again."""
        if self.ckpt is None or self.pending is None:
            return []
        if not block and self.ckpt.busy:
            return []
        (step, metrics), self.pending = self.pending, None
        try:
            self.ckpt.wait()
        except Exception as e:  # a failed save: this step stays unacknowledged for now
            log.error("checkpoint of step %d failed, its ack waits for the next: %s", step, e)
            return []
        self.durable = max(self.durable, step)
        return [self.client.ack_batch(step, metrics)]

    def close(self) -> list[BatchAckReply]:
        """The loop is over: wait for the last save and send its ack."""
        return self.poll(block=True)


def policy_checkpointer(root: Any) -> Checkpointer | None:
    """The checkpointer of the policy's state under ``root`` (a path or a storage
    URL; None: no checkpoints). Two kept: the newest and the one being replaced."""
    if root is None:
        return None
    from phalanx.checkpoint import Checkpointer

    return Checkpointer(str(root), keep_last=2, layout={"kind": "rl-policy"})

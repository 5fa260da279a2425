"""The policy's state through the async DCP checkpointer, and acks that split
"trained" from "durable".

A policy replica's ack tells the ledger two things:

- **committed** (``step``): weights may sync from this step. The ack goes at
  once at each ack point, so the rollout replicas get new weights without
  waiting for any checkpoint;
- **durable** (``durable``): the steps a committed checkpoint holds. Only
  those batches are dropped (payloads freed, prompts done). That is safe only
  once the step survives the loss of every policy replica.

Rank 0 of the quorum (the policy leader: every member holds the same state
after a commit) saves with ``Checkpointer.save_async``. The step stalls only
for the copy to host memory, and training goes on. One save runs at a time:
the steps committed meanwhile wait for the next one, which starts as soon as
the one in flight commits (polled between steps and while waiting for a
batch). Its commit sends an ack that moves ``durable``. The other members
send no ack; their batch asks tell the controller only the steps they know to
be durable (``BatchLeaseReq.durable``).

A restarted replica resumes from the newest committed checkpoint, which is
never behind what the ledger dropped; the ledger re-offers the batches of any
steps after it, and rewinds the weight versions to it (the rollout replicas
get the resumed lineage at the next sync). Nothing committed is lost and
nothing is trained twice. Without a checkpointer (no ``--state``), acks are
durable at once, as the replica's memory is all there is.
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
    """Acks of one policy replica: committed at once, durable once a checkpoint
    holds the step.

    Who calls: the replica's training loop, single-threaded: :meth:`ack` at each
    ack point after the commit, :meth:`poll` between steps and while waiting for a
    batch (the state is a committed one there), :meth:`close` at the end (it saves
    the last step if no save holds it, and sends its ack).
    """

    def __init__(self, client: ControllerClient, ckpt: Checkpointer | None, extra: dict[str, Any]):
        self.client, self.ckpt, self.extra = client, ckpt, extra
        self.saving: int | None = None
        """The step of the save in flight."""
        self.behind = False
        """A step was committed after the newest save started: it waits for the next."""
        self.manager: Manager | None = None
        self.durable = 0
        """The newest step known to be in a committed checkpoint (resumed or saved)."""
        self.started: int | None = None
        """The step of a save started since :meth:`take_started` was last called (the
        other ranks of a sharded replica must start theirs: :mod:`phalanx.rl.policy_ranks`)."""

    @property
    def pending(self) -> bool:
        """A step is committed that no committed checkpoint holds yet."""
        return self.saving is not None or self.behind

    @property
    def durable_for_lease(self) -> int | None:
        """What a batch ask may acknowledge: None without a checkpointer (all of it)."""
        return None if self.ckpt is None else self.durable

    def ack(self, manager: Manager, metrics: BatchMetrics | None) -> list[BatchAckReply]:
        """An ack point: the step is committed (weights may sync from it). Without a
        checkpointer it is durable too. On the quorum's rank 0, a save of it starts
        now, or when the one in flight commits. Returns the replies of the acks sent."""
        if self.ckpt is None:
            return [self.client.ack_batch(manager.step, metrics)]
        if manager.rank != 0:
            return []
        self.manager, self.behind = manager, True
        return [self.client.ack_batch(manager.step, metrics, self.durable), *self.poll()]

    def poll(self, block: bool = False) -> list[BatchAckReply]:
        """If the save in flight committed (with ``block``: wait for it), send its
        durable ack; then start the next save if a newer step waits for one. A save
        that failed sends nothing: the next ack point saves again."""
        if self.ckpt is None:
            return []
        replies: list[BatchAckReply] = []
        m = self.manager  # set by the ack point that started any save
        if self.saving is not None and m is not None and (block or not self.ckpt.busy):
            step, self.saving = self.saving, None
            try:
                self.ckpt.wait()
            except Exception as e:  # this step stays undurable until a later save
                log.error("checkpoint of step %d failed, its ack waits for the next: %s", step, e)
                return replies
            self.durable = max(self.durable, step)
            # Its step is behind the committed one: an ack's step says what is
            # committed (an older one would read as a policy back from a checkpoint).
            replies.append(self.client.ack_batch(max(step, m.step), None, step))
        if self.saving is None and self.behind and m is not None and m.rank == 0:
            self.behind = False
            if m.step > self.durable:
                try:
                    self.ckpt.save_async(m.step, m.checkpoint_state(), self.extra)
                    self.saving = self.started = m.step
                except Exception as e:  # storage failed: the next ack point saves again
                    log.error("could not start the checkpoint of step %d: %s", m.step, e)
        return replies

    def finish(self, manager: Manager) -> list[BatchAckReply]:
        """The job's last step is reached and not yet durable (called at each round of
        the end, :mod:`phalanx.jobs.policy_end`): on the quorum's rank 0, make sure a
        save holds it, polling the one in flight or starting one. A replica that
        became rank 0 since (the saver died) saves it itself. Returns the replies of
        the acks sent."""
        if self.ckpt is None or manager.rank != 0:
            return []
        self.manager = manager
        if manager.step > self.durable and self.saving != manager.step:
            self.behind = True
        return self.poll()

    def stop_saving(self) -> None:
        """This replica's state is behind the job's (it finished elsewhere): no save
        starts any more, so that the root's newest checkpoint stays the job's. A save
        in flight is still waited for at :meth:`close`."""
        self.behind = False

    def take_started(self) -> int | None:
        """The step of the save started since the last call, if any (cleared)."""
        started, self.started = self.started, None
        return started

    def close(self) -> list[BatchAckReply]:
        """The loop is over: save the last step if no save holds it, wait, and ack."""
        replies: list[BatchAckReply] = []
        while self.pending:
            replies += self.poll(block=True)
            if self.saving is None:
                break  # a save failed, or nothing newer was left to save
        return replies


def policy_checkpointer(root: Any) -> Checkpointer | None:
    """The checkpointer of the policy's state under ``root`` (a path or a storage
    URL; None: no checkpoints). Two kept: the newest and the one being replaced."""
    if root is None:
        return None
    from phalanx.checkpoint import Checkpointer

    return Checkpointer(str(root), keep_last=2, layout={"kind": "rl-policy"})

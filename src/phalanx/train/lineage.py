"""The job's lineage as a replica meets it in each quorum.

The controller keeps the job's step from going back by accident
(:mod:`phalanx.controller.core.quorum`); what a replica must make of a quorum
is here:

- the job finished at a step this replica is behind, with no peer in the
  quorum that holds it: it stops (:class:`JobFinished`), writing no final
  state of its own;
- the quorum rolled the job back: it says so, once, in its log;
- the controller refused its state as one of a branch the job rolled back:
  it must restart (:class:`BranchAbandoned`), to resume from the checkpoint
  root or heal from a peer.
"""

from __future__ import annotations

from phalanx.client import Rejected
from phalanx.log import ReplicaLogger
from phalanx.protocol.quorum import QuorumView
from phalanx.train.base import BranchAbandoned, JobFinished


def check_quorum(q: QuorumView, total_steps: int | None, log: ReplicaLogger) -> None:
    """Raise :class:`JobFinished` when ``q`` comes after the job's last step (the
    quorum's, else ``total_steps``) and nobody in it holds that step; log a rollback
    that ``q`` made."""
    final = q.final_step if q.final_step is not None else total_steps
    if final is not None and q.job_step >= final > q.max_step:
        # The job ended (its last step committed by replicas that left) while this
        # one waited: training from its own older state would redo finished steps.
        raise JobFinished(
            f"the job committed its {final} steps while this replica waited "
            f"for a quorum (the quorum's newest step is {q.max_step})"
        )
    if q.rolled_back_from is not None:
        log.error(
            "the job rolled back from step %d to step %d: no live replica and no "
            "checkpoint held the steps after it (the controller waited for one); "
            "they are trained again",
            q.rolled_back_from,
            q.max_step,
        )


def abandoned(e: Exception) -> BranchAbandoned | None:
    """The :class:`BranchAbandoned` that a refused quorum request ``e`` means, if it
    is the controller's refusal of this replica's state."""
    if (
        isinstance(e, Rejected)
        and e.status == 409
        and any(f.field == "step" for f in e.body.fields)
    ):
        return BranchAbandoned(e.body.error)
    return None

"""The end of an RL job on a policy replica: every replica stops at the job's
last step, and none leaves before a save holds it.

The ledger decides the job's last step as soon as a step covering its last
batch commits (:mod:`phalanx.controller.core.ledger.rollouts`), and freezes no
batch past it; a replica learns it from a batch lease or an ack reply and
stops there. So the replicas of one job end on the same step, and their final
weight files are byte-identical (two replicas once ended a step apart: one saw
the job finish and left, the other had already leased the next batch and
trained it alone).

The job is *finished* only once a save holds that step. Until then each
replica goes on forming quorums, one round per :data:`END_POLL_S` at most: the
quorum's rank 0 saves the step (:meth:`DurableAcks.finish`), so that if the
replica that was saving it dies, the next rank 0 saves it instead; and a
replica that joins behind is healed to it by the quorum before it writes any
final file. A replica that finds the job finished while it is behind, with no
peer left to heal from, leaves without writing one: only the last step's
holders write the job's final files.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from phalanx.client import QuorumTimeout
from phalanx.jobs.common import emit
from phalanx.train.base import JobFinished

if TYPE_CHECKING:
    from phalanx.jobs.policy_ranks import Coordinator
    from phalanx.rl.durable import DurableAcks
    from phalanx.train.manager import Manager

log = logging.getLogger("phalanx.jobs.policy_end")


def joined_finished(client: Any) -> None:
    """Say ``done`` for a policy replica that registered after the job finished: it
    holds none of the last step and writes no final file, as one that fell behind a
    finished job (``finished_elsewhere``); then leave the controller. The leader's."""
    rid = client.replica_id
    emit({"event": "done", "role": "policy", "replica": rid, "step": 0, "finished_elsewhere": True})
    client.close("job already finished")


END_POLL_S = 1.0
"""How long a replica at the last step waits for the job to finish before it forms
a quorum again (to take over a save whose saver died)."""


def finish(coord: Coordinator, manager: Manager, acks: DurableAcks, client: Any) -> bool:
    """Wait, at the job's last step, until a save holds it. Every rank of the replica
    calls it (``client`` is the leader's: the others pass theirs, unused). Returns
    True once the job is finished, False when it finished elsewhere while this
    replica was behind it (it holds none of the last step)."""
    lead = coord.ranks.leader
    while True:
        try:
            manager.start_quorum()
            manager.wait_quorum()
        except QuorumTimeout as e:
            log.warning("%s; asking again", e)
            continue
        except JobFinished as e:
            log.info("%s; nothing left to do", e)
            acks.stop_saving()
            return False
        plan = None
        if lead:
            replies = acks.finish(manager)
            r = client.lease_batch(manager.step, END_POLL_S, acks.durable_for_lease)
            plan = coord.plan([r, *replies])
        plan = coord.agree(plan)
        if plan.finished:
            return True

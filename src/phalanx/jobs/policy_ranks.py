"""The ranks of one policy replica, and what they must do alike.

A policy replica is one process, or N ranks that shard the model with FSDP2
(``[replica] ranks = N``; :mod:`phalanx.train.hsdp`). Only rank 0, the
replica's *leader*, talks to the controller: it leases the step's batch,
acknowledges commits, reads the operator's orders and decides when the
policy's state is saved. Whatever of that changes what the ranks compute or
which collectives they run must reach every rank at the same point of the
loop, so the leader folds it into a :class:`Plan` and :meth:`Coordinator.agree`
broadcasts it (JSON over the replica's gloo control group: no pickle) and
carries it out on every rank:

- ``save``: the leader started an async save of this step (its DurableAcks
  decided when); every other rank saves its shards of the same step, since a
  DCP save is a collective over the replica's ranks;
- ``sync``: this replica is the source of a weight sync; every rank gathers
  the full tensors, one at a time (FSDP's all-gathers pair up), and the
  leader packs each into the one buffer it sends, so no rank ever holds the
  whole model twice;
- ``batch`` and ``rows``: the step's rollouts, read by the leader (from the
  controller or the rollout store), so that every rank trains its part of
  the same rows; ``abstain`` when some could not be read;
- ``finished``, ``at_end`` and ``drain``: every rank leaves the loop at the same
  step (``at_end``: the job's last step is reached; the replica waits for a save
  to hold it, :mod:`phalanx.jobs.policy_end`).

A replica of one rank (:class:`~phalanx.jobs.replica_ranks.OneRank`) broadcasts nothing: ``agree`` only
carries the plan out.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from phalanx.jobs.common import emit
from phalanx.log import ReplicaLogger
from phalanx.protocol.rl import RolloutPayload, SyncOrder
from phalanx.rl.lora import adapter_state, is_lora
from phalanx.transport.collective import Packed

if TYPE_CHECKING:
    from phalanx.checkpoint import Checkpointer
    from phalanx.rl.durable import DurableAcks
    from phalanx.rl.trainer import Rows
    from phalanx.train.manager import Manager
    from phalanx.transport.base import SyncResult, WeightChannel

log = logging.getLogger("phalanx.rl.policy_ranks")


@dataclass
class Plan:
    """What the leader decided at one point of the loop, for every rank (module doc)."""

    finished: bool = False
    sync: SyncOrder | None = None
    save: int | None = None
    batch: int | None = None
    rows: Rows = field(default_factory=list)
    abstain: str | None = None
    drain: bool = False
    at_end: bool = False
    """The job's last step is reached: train no more (:mod:`phalanx.jobs.policy_end`)."""
    more: bool = False
    """(closing) a save was started: the ranks meet again once it is waited for."""

    def to_json(self) -> dict[str, Any]:
        return {
            "finished": self.finished,
            "sync": self.sync.model_dump_json() if self.sync is not None else None,
            "save": self.save,
            "batch": self.batch,
            "rows": [[i, p.model_dump_json()] for i, p in self.rows],
            "abstain": self.abstain,
            "drain": self.drain,
            "at_end": self.at_end,
            "more": self.more,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Plan:
        return cls(
            finished=bool(d["finished"]),
            sync=SyncOrder.model_validate_json(d["sync"]) if d["sync"] is not None else None,
            save=d["save"],
            batch=d["batch"],
            rows=[(int(i), RolloutPayload.model_validate_json(p)) for i, p in d["rows"]],
            abstain=d["abstain"],
            drain=bool(d["drain"]),
            at_end=bool(d["at_end"]),
            more=bool(d["more"]),
        )


def full_weights(model: torch.nn.Module, keep: bool) -> Packed | None:
    """The model's whole tensors, gathered one at a time (a collective over the
    replica's ranks when the model is sharded: every rank calls it, in the same
    order). With ``keep`` (the leader) they are packed into one host buffer,
    sorted by name (:func:`phalanx.transport.collective.pack`'s layout), and each
    gathered tensor is freed once copied: the buffer is the one whole copy this
    rank holds. The other ranks drop each tensor at once and get None."""
    sd = adapter_state(model) if is_lora(model) else model.state_dict()  # LoRA: the adapter
    names = sorted(sd)
    out: Packed | None = None
    if keep:
        out = Packed({k: _meta_like(sd[k]) for k in names})
    for k in names:
        t = sd[k]
        whole = t.full_tensor() if isinstance(t, DTensor) else t
        if out is not None:
            out.fill(k, whole)
        del whole
    return out


def full_optimizer_state(opt: torch.optim.Optimizer, keep: bool) -> dict[str, Any] | None:
    """The optimizer's per-parameter state, each tensor whole (gathered over the
    replica's ranks when sharded: a collective, every rank calls it), by parameter
    index: for the final state file. The leader (``keep``) gets it, others None."""
    out: dict[str, Any] = {}
    for pid, st in sorted(opt.state_dict()["state"].items()):
        got = {}
        for k, v in sorted(st.items()):
            whole = v.full_tensor() if isinstance(v, DTensor) else v
            got[k] = whole.detach().cpu().clone() if isinstance(whole, torch.Tensor) else whole
        out[str(pid)] = got
    return out if keep else None


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


class Publisher:
    """Sends the committed weights when a sync order names this replica as its
    source (the quorum's rank 0, the policy leader), at the step boundary: every
    rank takes part in gathering them (:func:`full_weights`), the leader's channel
    sends them in the background and reports the outcome to the controller."""

    def __init__(self, client: Any, weights: WeightChannel | None, leader: bool):
        self.client, self.weights, self.leader = client, weights, leader
        self.published = 0
        self.rlog = ReplicaLogger(log, client.who)

    def report(self, res: SyncResult) -> None:
        emit(
            {
                "event": "sync",
                "role": "policy",
                "replica": self.client.replica_id,
                "seq": res.seq,
                "version": res.version,
                "ms": round(1e3 * res.seconds, 3),
                "bytes": res.nbytes,
                "members": res.members,
                "ok": res.ok,
                "error": res.error[:200],
            }
        )
        try:
            self.client.sync_done(res.seq, res.version, res.ok, res.error)
        except Exception as e:  # the controller times the sync out if this is lost
            self.rlog.warning("sync report not delivered: %s", e)

    def serve(self, order: SyncOrder | None, step: int, model: torch.nn.Module) -> None:
        """Every rank, with the plan's order (the same on all of them)."""
        if order is None or order.seq <= self.published or order.rank != 0:
            return
        self.published = order.seq
        snapshot = full_weights(model, keep=self.leader)
        if self.leader and self.weights is not None and snapshot is not None:
            self.weights.publish(step, snapshot, order, self.report)


class Coordinator:
    """The agreement points of one policy replica's loop (module doc).

    Who calls: every rank, at the same points of the loop; the leader passes the
    plan it built with :meth:`plan`, the others None. ``agree`` is a collective
    over the replica's ranks when there are several."""

    def __init__(
        self,
        ranks: Any,
        manager: Manager,
        acks: DurableAcks,
        publisher: Publisher,
        ckpt: Checkpointer | None,
        extra: dict[str, Any],
    ):
        self.ranks, self.manager, self.acks = ranks, manager, acks
        self.publisher, self.ckpt, self.extra = publisher, ckpt, extra

    def plan(self, replies: Iterable[Any] = (), **fields: Any) -> Plan:
        """(Leader) a plan from the controller's replies (lease or ack replies: each
        may say the job finished, or carry a sync order) and the save the leader's
        acks just started."""
        p = Plan(**fields)
        for r in replies:
            p.finished = p.finished or bool(r.finished)
            final = r.final_step
            p.at_end = p.at_end or (final is not None and self.manager.step >= final)
            if r.sync is not None:
                p.sync = r.sync
        p.save = self.acks.take_started()
        return p

    def agree(self, plan: Plan | None) -> Plan:
        """The leader's ``plan`` on every rank, carried out there: the other ranks
        save their shards of a save the leader started, and every rank takes part
        in a weight sync this replica sources."""
        if self.ranks.size > 1:
            msg = self.ranks.broadcast_json(plan.to_json() if plan is not None else None)
            plan = Plan.from_json(msg)
        if plan is None:
            raise ValueError("Coordinator.agree: the leader must pass its plan")
        if plan.save is not None and not self.ranks.leader and self.ckpt is not None:
            self._save_shards(plan.save)
        self.publisher.serve(plan.sync, self.manager.step, self.manager.model)
        return plan

    def _save_shards(self, step: int) -> None:
        assert self.ckpt is not None
        try:
            self.ckpt.wait()
        except Exception as e:  # the leader saw it fail too: that step stays undurable
            log.warning("rank %d: the previous checkpoint failed: %s", self.ranks.rank, e)
        self.ckpt.save_async(step, self.manager.checkpoint_state(), self.extra)

    def close(self) -> bool:
        """The loop is over: the leader saves the last step if no save holds it, waits
        and acks (DurableAcks.close), each save met by every rank. Returns whether
        the job finished."""
        finished = False
        while True:
            plan = None
            if self.ranks.leader:
                replies = self.acks.poll(block=True) if self.acks.pending else []
                plan = self.plan(replies)
                plan.more = self.acks.saving is not None
            plan = self.agree(plan)
            finished = finished or plan.finished
            if not plan.more:
                break
        if self.ckpt is not None and not self.ranks.leader:
            try:
                self.ckpt.wait()
            except Exception as e:
                log.warning("rank %d: the last checkpoint failed: %s", self.ranks.rank, e)
        return finished

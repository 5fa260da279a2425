"""Replicas of several ranks: FSDP2 inside a replica, fault tolerance across
replicas (HSDP; DESIGN.md, replicas of several ranks).

A replica's N ranks shard its model with ``fully_shard`` on a one-dimensional
device mesh over torch.distributed's default group (the replica's own world,
started by :mod:`phalanx.launch.ranks` or torchrun). Across replicas, rank
``r`` of every participating replica forms the cross-replica group of shard
``r``: its gradients are summed there, and a joiner's rank ``r`` heals from
rank ``r`` of a healthy replica. Each step:

1. rank 0 (the replica's *leader*, the only rank that talks to the
   controller) asks for the quorum and broadcasts it to the other ranks over
   the replica's control group (gloo, JSON bytes: no pickle);
2. every rank builds its shard's cross-replica group for the quorum and heals
   its shard if the replica is behind; the ranks then agree (one tiny
   all-reduce) on whether all of that worked and on the step they hold;
3. every rank runs its part of the replica's share of the global batch (the
   same number of micro-batches on every rank, as FSDP needs);
4. every rank all-reduces its shard's gradients with the commit vote and the
   loss over its cross-replica group (rank 0 votes no there if its replica was
   evicted during the step: its group's no reaches every replica in step 5);
5. the replica commits only if every rank saw every replica vote yes in its
   group (a second tiny all-reduce inside the replica): the vote spans every
   rank of every participating replica.

A failure inside the replica (a rank died: a control all-reduce or an FSDP
collective raised) is not recoverable there: :class:`ReplicaBroken` ends the
rank, :mod:`phalanx.launch.ranks` stops the others, and the launcher restarts
the whole replica, which heals shard by shard. A failed cross-replica
collective is the usual FT case: the replica votes no, its leader reports the
peers, and the step is retried with the next quorum.
"""

from __future__ import annotations

from typing import Any

import torch

from phalanx.log import Who
from phalanx.protocol.quorum import QuorumView, layout_of
from phalanx.train.batch import split
from phalanx.train.exact_grads import ExactShardedGrads
from phalanx.train.heal import prefault_if_joining
from phalanx.train.manager import Compute, Manager
from phalanx.train.ranks import CONTROL_BYTES, ReplicaBroken, ReplicaRanks, env_ranks
from phalanx.train.shards import (
    ShardedGrads,
    checkpoint_to_local,
    load_local,
    local,
    local_tree,
)

__all__ = [
    "CONTROL_BYTES",
    "HSDPManager",
    "LayoutMismatch",
    "RankClient",
    "ReplicaBroken",
    "ReplicaRanks",
    "check_layout",
    "env_ranks",
    "local",
]


class LayoutMismatch(RuntimeError):
    """The quorum holds replicas of another layout (ranks, tp) than this one's."""


def check_layout(q: QuorumView, ranks: int, tp: int) -> None:
    """:class:`LayoutMismatch`, naming both layouts in one line, when a member of
    ``q`` has another layout than ``(ranks, tp)``: rank r of one layout holds other
    shards than rank r of another, so their groups would never pair. (The controller
    refuses such a registration; a quorum formed before, or by an older controller,
    is caught here.)"""
    other = sorted({(m.ranks, m.tp) for m in q.members} - {(ranks, tp)})
    if other:
        theirs = ", ".join(layout_of(r, t) for r, t in other)
        raise LayoutMismatch(
            f"this replica spans {layout_of(ranks, tp)} but the quorum's other replicas span "
            f"{theirs}: every replica of a job must have the same [replica] ranks and tp"
        )


class RankClient:
    """The replica's identity on a rank other than 0, as the leader received it
    with each quorum. Only the leader talks to the controller: it reports the
    replica's progress and heals, and the failures its ranks relay to it
    (:meth:`report_failure` keeps them for that)."""

    def __init__(self, role: str, name: str, rank: int):
        self.who = Who(role=role, replica_id=name, rank=rank)
        self.replica_id: str | None = None
        self.incarnations = 0
        self.failure: str | None = None

    def report_progress(self, **_: Any) -> None:
        """The leader reports the replica's progress (it commits the same steps)."""

    def report_heal(self, *_: Any) -> None:
        """The leader reports the replica's heal (every rank heals its shard)."""

    def report_failure(self, peers: list[str], reason: str, failed_commit: bool = False) -> None:
        self.failure = reason


class HSDPManager(Manager):
    """The FT manager of one rank of a replica of several ranks (module doc).

    ``client`` is the controller client on rank 0 and a :class:`RankClient`
    on the others; ``comm`` is this rank's cross-replica communicator."""

    def __init__(self, client: Any, ranks: ReplicaRanks, *args: Any, **kwargs: Any):
        self.ranks = ranks
        super().__init__(client, *args, **kwargs)
        self.replica_indices: list[int] = []
        self._replica_at_quorum: str | None = None
        """The replica's id as broadcast with the last quorum: the same on every rank,
        unlike rank 0's live client, which may register again at any moment."""
        self._incarnation_at_quorum = -1
        """Rank 0's incarnation count, broadcast with the same quorum."""

    def _make_grads(self, model: torch.nn.Module, bucket_bytes: int) -> Any:
        if self.exact:
            return ExactShardedGrads(model, bucket_bytes)
        return ShardedGrads(model, bucket_bytes)

    def _unit_size(self) -> int:
        """An exact unit: a micro-batch on each rank of the replica (:meth:`_run`
        splits it over them), so that FSDP's reduce-scatter sums the same samples
        in the same order whichever replica computes it. The ranks of a TP group
        compute the same micro-batch."""
        return self.micro_batch_size * self.ranks.dp_size

    # -- state: this rank's shards ----------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return local_tree(super().state_dict())

    def checkpoint_state(self) -> dict[str, Any]:
        return Manager.state_dict(self)

    def checkpoint_layout(self) -> dict[str, Any]:
        return {**super().checkpoint_layout(), "ranks": self.ranks.size, "tp": self.ranks.tp}

    def load_checkpoint(self, sd: dict[str, Any]) -> None:
        """A checkpoint saved by a replica of any size or layout (:func:`checkpoint_to_local`)."""
        self.load_state_dict(checkpoint_to_local(self.model, self.optimizer, sd))

    def _load_model(self, sd: dict[str, Any]) -> None:
        load_local(self.model, self.optimizer, sd, self.trainable_only)

    # -- quorum: the leader's, on every rank ------------------------------

    def start_quorum(self) -> None:
        if self.ranks.leader:
            super().start_quorum()
        else:
            prefault_if_joining(self)

    def _take_quorum(self) -> QuorumView:
        from phalanx.client import QuorumTimeout

        if self.ranks.leader:
            try:
                q = super()._take_quorum()
            except Exception as e:
                kind = "timeout" if isinstance(e, QuorumTimeout) else "error"
                self.ranks.broadcast_json({"raise": kind, "message": str(e)[:2000]})
                raise
            inc = self.client.incarnations  # first: see Manager._identity
            rid = self.client.replica_id
            self.ranks.broadcast_json(
                {"quorum": q.model_dump_json(), "replica_id": rid, "incarnations": inc}
            )
            self._replica_at_quorum, self._incarnation_at_quorum = rid, inc
            self._check_layout(q)
            return q
        msg = self.ranks.broadcast_json()
        if "raise" in msg:
            if msg["raise"] == "timeout":
                raise QuorumTimeout(msg["message"])
            raise RuntimeError(f"rank 0 of this replica failed to get a quorum: {msg['message']}")
        self.client.replica_id = msg["replica_id"]
        self.client.who.replica_id = msg["replica_id"]
        self.client.incarnations = msg["incarnations"]
        self._replica_at_quorum = msg["replica_id"]
        self._incarnation_at_quorum = msg["incarnations"]
        q = QuorumView.model_validate_json(msg["quorum"])
        self._check_layout(q)
        return q

    def predicted_share(self) -> tuple[int, int] | None:
        """The share the last quorum gave this replica, from what every rank of the
        replica holds alike (the last broadcast), so that all ranks make the same
        choice to compute ahead of the quorum: FSDP's collectives pair up. (Rank 0's
        client may have registered again since: the share then changes with the
        next quorum, and every rank recomputes.)"""
        q, me = self.quorum, self._replica_at_quorum
        if q is None or me not in q.replica_ids:
            return None
        return q.replica_ids.index(me), len(q.members)

    def _group_prefix(self, q: QuorumView) -> str:
        tp = f"/t{self.ranks.tp}" if self.ranks.tp > 1 else ""  # (names of tp = 1 as before)
        return f"{super()._group_prefix(q)}/n{self.ranks.size}{tp}/s{self.ranks.rank}"

    def _identity(self) -> tuple[str | None, int]:
        """What rank 0 took the quorum as, alike on every rank (its broadcast)."""
        return self._replica_at_quorum, self._incarnation_at_quorum

    def wait_quorum(self) -> QuorumView:
        heals = self.heals
        q = super().wait_quorum()
        self._agree("the quorum's setup")
        if self._replica_at_quorum in q.heal:  # alike on every rank: all heal their shards
            self._replica_heal(self.heals > heals)
        return q

    def _replica_heal(self, healed: bool) -> None:
        """Add the whole replica's heal to :attr:`last_heal` as ``replica``: every
        rank's shard bytes, and the time from the first shard's first bytes to the
        last shard's last (wall clocks: one host's ranks agree), when every rank
        healed. A max over the replica's ranks, each filling its own slot."""
        n, rec = self.ranks.size, self.last_heal
        mine = [0.0] * n + [float("-inf")] * 2
        if healed:
            mine[self.ranks.rank] = float(rec["bytes"])
            mine[n:] = [-rec["started_at"], rec["received_at"]]
        got = self.ranks.max(mine)
        if healed and min(got[:n]) > 0:
            rec["replica"] = {"bytes": int(sum(got[:n])), "transfer_s": got[n + 1] + got[n]}

    def _check_layout(self, q: QuorumView) -> None:
        check_layout(q, self.ranks.size, self.ranks.tp)

    def _agree(self, what: str) -> None:
        """Make this rank's outcome the replica's: if any rank failed (or the
        ranks hold different steps after a partial heal), every rank votes no
        and the leader reports the failure; the lowest step is taken by all,
        so that the next quorum heals the whole replica."""
        failure = self._failure()
        not_ok, failed, neg_low, high = self.ranks.max(
            [float(not self._ok), float(failure is not None), -float(self.step), float(self.step)]
        )
        low = -round(neg_low)
        if low != round(high):
            self.log.warning(
                "the replica's ranks hold steps %d..%d after %s: all go back to %d to be healed",
                low,
                round(high),
                what,
                low,
            )
            self.step = low
            self.accumulator.forget()  # (on every rank alike: their next computes pair up)
            self.client.who.step = low
            if self.ranks.leader:
                self.client.report_progress(step=low)
        if not_ok:
            if self.ranks.leader and failed and self._ok:
                self._report_peers(f"a rank of this replica failed in {what}")
            if self._ok:
                self._ok, self._error = False, f"another rank of this replica failed in {what}"
                self._configured = None
                self.comm.abort()

    def _failure(self) -> str | None:
        """This rank's failure in the step so far (its own, or one its
        :class:`RankClient` kept to relay), taken: a kept one is relayed once."""
        failure = self._error or getattr(self.client, "failure", None)
        if isinstance(self.client, RankClient):
            self.client.failure = None
        return failure

    # -- data: the replica's share, split over its ranks -------------------

    def compute(self, fn: Compute, rank: int, world_size: int) -> float:
        total = super().compute(fn, rank, world_size)
        self.replica_indices = self.last_indices  # the replica's share, all ranks'
        return total

    def _run(self, fn: Compute, indices: list[int]) -> float:
        """This rank's part of ``indices`` (some of the replica's share), in as many
        micro-batches as every other rank of the replica runs (FSDP's collectives
        pair up); ranks with fewer samples run empty ones. Returns the summed loss.

        The share is split over the replica's data-parallel ranks: the ranks of one
        TP group run the same micro-batches, and only the group's first counts
        their loss (the replica's loss is a sum over its ranks)."""
        if not indices:
            return 0.0
        n, me = self.ranks.dp_size, self.ranks.dp_rank
        sub_off, sub_count = split(len(indices), n, me)
        mine = indices[sub_off : sub_off + sub_count]
        most = -(-len(indices) // n)
        total = 0.0
        for i in range(-(-most // self.micro_batch_size)):
            mb = mine[i * self.micro_batch_size : (i + 1) * self.micro_batch_size]
            total += float(fn(mb, 1.0 / self.global_batch_size))
        return total if self.ranks.rank % self.ranks.tp == 0 else 0.0

    # -- gradients and the replica-wide vote -------------------------------

    def allreduce_grads(self, loss_sum: float = 0.0) -> float:
        total = super().allreduce_grads(loss_sum)
        ok = self._ok and self.grads.vote_ok
        failure = self._failure()
        votes, failed, loss = self.ranks.sum(
            [float(ok), float(failure is not None), total if ok else 0.0]
        )
        if round(votes) == self.ranks.size:
            assert isinstance(self.grads, ShardedGrads)
            self.grads.publish()
        else:
            self.grads.vote_ok = False
            if self.ranks.leader and failed and self._ok:
                self._report_peers("a rank of this replica failed in the gradient all-reduce")
            if self._ok and failed:
                self._configured = None
                self.comm.abort()
            return float("nan")
        return loss

    def close(self) -> None:
        super().close()

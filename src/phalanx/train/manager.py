"""The per-replica FT data-parallel manager: quorum per step, all-reduce,
commit everywhere or nowhere, live heal.

One :class:`Manager` per replica. A step goes::

    start_quorum()          ask the controller, in the background
    (speculative compute)   forward/backward on the share the last quorum implies
    wait_quorum()           rebuild the process group if quorum_id changed; heal
    (compute what is new)   only the samples the quorum's share adds to what the
                            gradients already hold (nothing if the guess was right)
    allreduce_grads()       bucketed sum; loss was pre-scaled by 1/global_batch
    should_commit()         every participant succeeded -> step the optimizer

:meth:`Manager.train_step` runs exactly that; the pieces are public for
loops that need to own the order (the RL policy replicas do).

Failure handling: a :class:`~phalanx.comm.base.CommError` anywhere (dead or hung
peer) makes this replica vote no, report every other participant as a suspect (the
controller probes them, so live ones are not evicted) with ``failed_commit``, and the
step is retried with the next quorum. A replica that voted no while others committed
is one step behind at the next quorum and heals, so the replicas never diverge.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from phalanx.client import ControllerClient, QuorumTimeout, Rejected
from phalanx.comm.base import CommError, Communicator
from phalanx.data.sampler import ElasticSampler
from phalanx.log import ReplicaLogger
from phalanx.net import unreachable, wait_for_most
from phalanx.protocol.quorum import QuorumView
from phalanx.train.base import Compute, StepResult
from phalanx.train.batch import micro_batches
from phalanx.train.exact_grads import ExactGrads, ExactShardedGrads
from phalanx.train.grads import GradBuffer
from phalanx.train.heal import PrefaultedBuffer, heal_in_quorum, prefault_if_joining
from phalanx.train.lineage import abandoned, check_quorum
from phalanx.train.rng import rng_state, set_rng_state
from phalanx.train.share import Accumulator
from phalanx.train.trainable import load_model_state, model_state


class Manager:
    def __init__(
        self,
        client: ControllerClient,
        comm: Communicator,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        sampler: ElasticSampler | None,
        *,
        global_batch_size: int,
        micro_batch_size: int | None = None,
        bucket_bytes: int = 25 << 20,
        quorum_timeout_s: float | None = None,
        exact_reduction: bool = False,
        trainable_only: bool = False,
    ):
        if global_batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1: got {global_batch_size}.")
        self.client = client
        self.comm = comm
        self.model = model
        self.optimizer = optimizer
        self.sampler = sampler
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size or global_batch_size
        self.quorum_timeout_s = quorum_timeout_s
        self.exact = exact_reduction
        """Sum the gradients exactly, over fixed units (:mod:`phalanx.train.exact_grads`)."""
        self.trainable_only = trainable_only
        """Heal and checkpoint only the trainable parameters (LoRA: the frozen base is
        rebuilt from the model spec on every replica, :mod:`phalanx.train.trainable`)."""
        self.grads = self._make_grads(model, bucket_bytes)
        self.accumulator = Accumulator(
            self.grads, sampler, global_batch_size, self._unit_size() if self.exact else None
        )
        self.step = 0
        self.lineage = 0
        """The quorum in which the state was committed last (``QuorumReq.lineage``)."""
        self.quorum: QuorumView | None = None
        self._configured: tuple[int, ...] | None = None
        self._incarnation = -1
        self.rank, self.world_size = 0, 1
        self.extra: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self.log = ReplicaLogger(logging.getLogger("phalanx.train"), client.who)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="phalanx-quorum")
        self._pending: Future[QuorumView] | None = None
        self._heal_buffer = PrefaultedBuffer()
        self._ok = True
        self._error: str | None = None
        self._abstained: str | None = None
        self.heals = 0
        self.last_heal: dict[str, Any] = {}
        self.last_indices: list[int] = []
        """Sample indices of this replica's share in the last compute."""
        self.total_steps: int | None = None
        """The job's last step, if the loop sets it: a quorum formed after the job
        reached it raises :class:`JobFinished` instead of training alone."""

    def _make_grads(self, model: torch.nn.Module, bucket_bytes: int) -> GradBuffer:
        return ExactGrads(model, bucket_bytes) if self.exact else GradBuffer(model, bucket_bytes)

    def _unit_size(self) -> int:
        """Samples per exact unit: one micro-batch."""
        return self.micro_batch_size

    # -- state -----------------------------------------------------------

    def register_state(
        self, name: str, get: Callable[[], Any], set_: Callable[[Any], None]
    ) -> None:
        """Add state that heal (and checkpoints) must carry, e.g. an LR scheduler."""
        self.extra[name] = (get, set_)

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": model_state(self.model, self.trainable_only),
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "lineage": self.lineage,
            "sampler": self.sampler.state_dict() if self.sampler is not None else {},
            "rng": rng_state(),
            "extra": {k: get() for k, (get, _) in self.extra.items()},
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.accumulator.forget()
        self._load_model(sd)
        self.step, self.lineage = int(sd["step"]), int(sd.get("lineage", 0))
        if self.sampler is not None:
            self.sampler.load_state_dict(sd["sampler"])
        set_rng_state(sd["rng"])
        for k, v in sd["extra"].items():
            if k in self.extra:
                self.extra[k][1](v)
        self.client.report_progress(step=self.step)
        self.client.who.step = self.step

    def checkpoint_state(self) -> dict[str, Any]:
        """The state a checkpoint saves: :meth:`state_dict`, with any sharded tensor
        as the DTensor it is (the checkpoint records each shard's place, so a replica
        of any size loads it)."""
        return self.state_dict()

    def checkpoint_layout(self) -> dict[str, Any]:
        """How the job is laid out at this step, as a checkpoint's manifest records it
        (informational: any layout loads any other)."""
        return {"kind": "ft-ddp", "replicas": self.world_size}

    def load_checkpoint(self, sd: dict[str, Any]) -> None:
        """Load a checkpoint's state (:meth:`Checkpointer.load`'s, the model loaded
        into this manager's own tensors, the rest whole)."""
        self.load_state_dict(sd)

    def _load_model(self, sd: dict[str, Any]) -> None:
        """Model and optimizer of a state from :meth:`state_dict` (a heal's or a checkpoint's)."""
        load_model_state(self.model, sd["model"], self.trainable_only)
        self.optimizer.load_state_dict(sd["optimizer"])

    # -- quorum ----------------------------------------------------------

    def start_quorum(self) -> None:
        """Ask for this step's quorum in the background (call once per step,
        before the forward pass)."""
        if self._pending is None:
            q, peers = self.quorum, {}
            if q is not None and self.client.incarnations != self._incarnation:
                # Evicted: rejoin only once most of the last quorum's peers answer (cut
                # off from them, each rejoin would fail their next step again).
                me = self.client.replica_id
                peers = {m.replica_id: m.address for m in q.members if m.replica_id != me}
            self._pending = self._pool.submit(self._ask, self.step, peers)
            prefault_if_joining(self)

    def predicted_share(self) -> tuple[int, int] | None:
        """(rank, world_size) this replica will most likely have, from the last
        quorum, or None when it cannot be predicted (joiner, lagging)."""
        q = self.quorum
        if q is None or self.client.incarnations != self._incarnation:
            return None
        me = self.client.replica_id
        if me not in q.replica_ids:
            return None
        return q.replica_ids.index(me), len(q.members)

    def wait_quorum(self) -> QuorumView:
        """Wait for the quorum; rebuild the process group if ``quorum_id`` changed;
        heal this replica or its assigned lagging peers. CommError is recorded
        (this replica will vote no), not raised."""
        self.start_quorum()
        q = self._take_quorum()
        me, inc = self._identity()
        self.quorum = q
        self._ok, self._error, self._abstained = True, None, None
        check_quorum(q, self.total_steps, self.log)
        if me not in q.replica_ids:
            # Evicted (e.g. SIGSTOPped past the timeouts) while the request was in
            # flight: the client re-registered, and this quorum was formed for the
            # previous incarnation. Vote no; the retry asks as the new one and heals.
            self._ok, self._error = False, f"quorum {q.quorum_id} is a previous incarnation's"
            return q
        self.rank, self.world_size = q.replica_ids.index(me), len(q.members)
        self.accumulator.weights = q.shares  # a straggler's share is smaller
        self.client.who.quorum_id = q.quorum_id
        key = (q.quorum_id, inc)
        try:
            if self._configured != key:
                t0 = time.perf_counter()
                store = q.members[0].address
                self.comm.configure(store, self._group_prefix(q), self.rank, self.world_size)
                self.comm.watch({m.replica_id: m.address for m in q.members if m.replica_id != me})
                self._configured = key
                self.log.info(
                    "process group for quorum %d: %d replicas (%.0f ms)",
                    q.quorum_id,
                    self.world_size,
                    1e3 * (time.perf_counter() - t0),
                )
            self.comm.enter_round(q.round)  # peers not told of this round are not in it
            self._incarnation = inc
            self._heal(q, me)
        except CommError as e:
            self._fail(e)
        finally:
            self._heal_buffer.drop()
        return q

    def _identity(self) -> tuple[str | None, int]:
        """(replica id, incarnation count) this replica takes its quorum as, read once:
        the client registers a new incarnation from another thread when it learns it
        was evicted, and a step that took its rank from one id and looked itself up
        in the heal plan under the other skipped its heal (found under packet loss:
        two replicas trained the same step from different states). The count is
        read first, so that a registration in between gives the new id (not in the
        quorum: this replica votes no), never an old id with the new count."""
        inc = self.client.incarnations
        return self.client.replica_id, inc

    def _still_this_incarnation(self) -> bool:
        """Whether the incarnation that took the quorum is still this replica's: one
        evicted meanwhile must not commit (its peers may already go on without it,
        from the same step)."""
        return self.client.incarnations == self._incarnation

    def _ask(self, step: int, peers: dict[str, str]) -> QuorumView:
        timeout = self.quorum_timeout_s or 60.0
        if peers:
            try:
                wait_for_most(peers, time.monotonic() + timeout, "the last quorum's peers")
            except TimeoutError as e:
                raise QuorumTimeout(f"not rejoining yet: {e}") from None
        timing = self.accumulator.timing()
        return self.client.quorum(step, self.quorum_timeout_s, self.lineage, timing)

    def _take_quorum(self) -> QuorumView:
        """The quorum asked for by :meth:`start_quorum` (waits for it). Raises
        :class:`~phalanx.train.base.BranchAbandoned` when the controller refused this
        replica's state as one of a branch the job rolled back."""
        assert self._pending is not None
        try:
            return self._pending.result()
        except Rejected as e:
            raise abandoned(e) or e from None
        finally:
            self._pending = None

    def _group_prefix(self, q: QuorumView) -> str:
        """The store prefix of this quorum's process group."""
        return f"{q.role}/q{q.quorum_id}"

    def _heal(self, q: QuorumView, me: str | None) -> None:
        """Receive this replica's heal, or send the heals it is the source of."""
        heal_in_quorum(self, q, me)

    # -- gradients and commit --------------------------------------------

    def share(self) -> list[int]:
        """This replica's sample positions of the current (uncommitted) global batch."""
        return self.accumulator.share(self.rank, self.world_size)

    def compute(self, fn: Compute, rank: int, world_size: int) -> float:
        """Accumulate the gradients of this replica's share, as ``(rank,
        world_size)`` gives it, in micro-batches; returns the share's summed loss.
        What the gradients already hold of it for this step (computed ahead of the
        quorum, or in an attempt whose exchange failed) is not computed again
        (:mod:`phalanx.train.share`)."""
        loss, self.last_indices = self.accumulator.compute(
            self.step, rank, world_size, lambda indices: self._run(fn, indices)
        )
        return loss

    def _run(self, fn: Compute, indices: list[int]) -> float:
        """``fn`` over ``indices`` in micro-batches; the summed loss."""
        total = 0.0
        for mb in micro_batches(indices, self.micro_batch_size):
            total += float(fn(mb, 1.0 / self.global_batch_size))
        return total

    def allreduce_grads(self, loss_sum: float = 0.0) -> float:
        """Sum the gradients over the quorum (bucketed). Returns the summed loss of
        the global batch. CommError is recorded, not raised."""
        if not self._ok:
            return float("nan")
        try:
            vote = self._yes()
            total = self.grads.allreduce(self.comm, self.world_size, loss_sum, vote=vote)
        except CommError as e:
            self._fail(e)
            return float("nan")
        if isinstance(self.grads, ExactGrads | ExactShardedGrads) and self.grads.units.nonfinite:
            # Every member learnt it in the same collective: none commits. Raises
            # once the step was found non-finite NONFINITE_TRIES times running.
            self.accumulator.forget()
            self._abstained = self.grads.units.refuse_nonfinite(self.step, self.share())
        return total

    def vote(self, loss_sum: float = 0.0) -> float:
        """The commit vote alone, with no gradients: for loops whose exchange is
        not a gradient all-reduce (DiLoCo's outer rounds). Returns the group's
        summed loss. CommError is recorded, not raised; then
        :meth:`should_commit` says False."""
        self.grads.vote_ok = False
        if not self._ok:
            return float("nan")
        yes = 1.0 if self._yes() else 0.0
        meta = torch.tensor([yes, loss_sum], dtype=torch.float64, device=self.comm.device)
        try:
            self.comm.allreduce([meta], "sum")
        except CommError as e:
            self._fail(e)
            return float("nan")
        self.grads.vote_ok = round(meta[0].item()) == self.world_size
        return float(meta[1])

    def _yes(self) -> bool:
        """This replica's commit vote, cast in the step's all-reduce: no if it was
        evicted during the step, so that the whole group retries. An eviction learned
        after the vote changes nothing: every member voted yes and commits alike."""
        if self._abstained is None and not self._still_this_incarnation():
            self._abstained = "evicted during the step: its peers may go on without it"
        return self._abstained is None

    def abstain(self, reason: str) -> None:
        """Vote no in this step without blaming a peer: this replica cannot train it
        (its data is not there, e.g. a rollout payload could not be read). It still
        takes part in the step's all-reduce, so every participant learns it there and
        retries; nobody is reported and the group is kept. Call between
        :meth:`wait_quorum` and :meth:`allreduce_grads`."""
        self._abstained = reason

    def fail(self, e: Exception) -> None:
        """Record a failed collective made outside the manager (e.g. by a DiLoCo
        reducer over :attr:`comm`): vote no, report the peers, drop the group."""
        self._fail(e)

    @property
    def error(self) -> str | None:
        """Why this replica votes no in the current step, if it does."""
        return self._error or self._abstained

    @property
    def ok(self) -> bool:
        """Whether this replica can still vote yes in the current step."""
        return self._ok

    def should_commit(self) -> bool:
        """Whether every participant succeeded this step.

        Call on every replica after :meth:`allreduce_grads` and before the
        optimizer step; step the optimizer only if it returns True. On True
        the step counter and the data cursor advance. On False the step is
        to be retried (call :meth:`start_quorum` again)."""
        ok = self._ok and self.grads.vote_ok
        if ok:
            self.step += 1
            self.lineage = self.quorum.quorum_id if self.quorum is not None else 0
            if self.sampler is not None:
                self.sampler.commit(self.global_batch_size)
            self.client.report_progress(step=self.step)
            self.client.who.step = self.step
        return ok

    def _fail(self, e: Exception) -> None:
        self._ok, self._error = False, str(e)
        self._configured = None
        self.comm.abort()
        self._report_peers(str(e))

    def _report_peers(self, reason: str) -> None:
        """Report (``failed_commit``) the peers this replica cannot reach (dead, or cut
        off: the controller then finds a partition's minority), else all of them."""
        q = self.quorum
        me = self.client.replica_id
        addrs = {m.replica_id: m.address for m in (q.members if q else ()) if m.replica_id != me}
        peers = unreachable(addrs) or list(addrs)
        self.log.warning("collective failed, reporting %d peer(s): %s", len(peers), reason[:200])
        try:
            self.client.report_failure(peers, reason=reason[:500], failed_commit=True)
        except Exception as report_error:  # the retry will surface a dead controller
            self.log.error("failure report not delivered: %s", report_error)

    # -- the whole step --------------------------------------------------

    def train_step(self, fn: Compute) -> StepResult:
        """One FT data-parallel step over the constant global batch.

        Must be called by every replica, once per loop iteration; it either
        commits (optimizer stepped, cursor advanced) or returns
        ``committed=False`` and the caller calls it again for the same batch."""
        self.start_quorum()
        guess, weights = self.predicted_share(), self.accumulator.weights
        loss = self.compute(fn, *guess) if guess is not None else None
        q = self.wait_quorum()
        healed = self.client.replica_id in q.heal
        if healed:
            self.accumulator.forget()  # the model changed under the gradients
        moved = guess != (self.rank, self.world_size) or weights != self.accumulator.weights
        if self._ok and (moved or healed):
            loss = self.compute(fn, self.rank, self.world_size)
        total = self.allreduce_grads(loss or 0.0)
        committed = self.should_commit()
        if committed:
            self.optimizer.step()
        return StepResult(
            committed,
            self.step,
            total / self.global_batch_size if committed else None,
            self.world_size,
            q.quorum_id,
            healed,
            self.error,
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._heal_buffer.close()
        self.comm.abort()

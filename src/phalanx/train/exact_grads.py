"""Gradients of an exact step (``train.exact_reduction``): one buffer per unit.

A *unit* is a fixed slice of the global batch: unit ``j`` holds the samples at
positions ``[j*u, (j+1)*u)`` of the step's global batch (``u`` samples: the
micro-batch size, times the ranks of a sharded replica), whoever computes it.
The replicas of a quorum share the units out with the remainder rule
(:func:`phalanx.train.batch.split` over the units, not the samples).

Each unit's gradient is kept apart, in a buffer of its own (a *slot*), with
its loss: summing the units in float on the replica would already make the
result depend on which units that replica got. At the exchange every slot is a
term of the exact sum (:class:`phalanx.train.exact.ExactSum`), and the result
lands where the float path puts it (``.grad``, or the shards' flats of HSDP),
so the optimizer step, heal and checkpoints are unchanged.

Memory: one gradient-sized slot per unit the replica computes in the step
(freed slots are kept for the next step), plus the exchange's int64 sums. The
slots are never written by the exchange: after a failed one, a retry with the
same units computes nothing again.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch

from phalanx.comm.base import Communicator
from phalanx.train.base import NonFiniteGradient
from phalanx.train.exact import ExactSum, Term
from phalanx.train.grads import GradBuffer
from phalanx.train.shards import ShardedGrads, take_grads

NONFINITE_TRIES = 3
"""Attempts of a step whose exchange finds a NaN or an Inf before the step raises."""


@dataclass
class Slot:
    """One unit's gradient: its flat buffers, their buckets and each parameter's view."""

    flats: list[torch.Tensor]
    buckets: list[torch.Tensor]
    views: list[torch.Tensor]
    loss: float = 0.0


class Units:
    """The slots of the units computed for the current step, and their exact sum."""

    def __init__(self, new_slot: Callable[[], Slot]):
        self.held: dict[int, Slot] = {}
        self._free: list[Slot] = []
        self._new_slot = new_slot
        self.sum = ExactSum()
        self.nonfinite = False
        """The last exchange found a NaN or an Inf in some member's unit."""
        self._nonfinite_at = (-1, 0)
        """(step, attempts running) found non-finite."""

    def take(self, unit: int, zero: bool = True) -> Slot:
        """A slot for ``unit`` (zeroed, unless its caller overwrites all of it)."""
        slot = self._free.pop() if self._free else self._new_slot()
        if zero:
            for f in slot.flats:
                f.zero_()
        slot.loss = 0.0
        self.held[unit] = slot
        return slot

    def keep(self, units: Collection[int]) -> None:
        """Free every slot but those of ``units``."""
        for u in [u for u in self.held if u not in units]:
            self._free.append(self.held.pop(u))

    def loss(self) -> float:
        return sum(s.loss for _, s in sorted(self.held.items()))

    def refuse_nonfinite(self, step: int, positions: list[int]) -> str:
        """Why the replica votes no after an exchange found a NaN or an Inf in
        ``step`` (``positions``: its share). A retry recomputes the units, so a
        transient fault passes; :class:`NonFiniteGradient` once the same step was
        found non-finite :data:`NONFINITE_TRIES` times running."""
        last, tries = self._nonfinite_at
        tries = tries + 1 if last == step else 1
        self._nonfinite_at = (step, tries)
        if tries >= NONFINITE_TRIES:
            raise NonFiniteGradient(
                f"the gradient of step {step} must be finite to be summed: it held a NaN or "
                f"an Inf in {tries} attempts running. Lower the learning rate, or look for "
                f"bad samples in the step's batch (this replica's: {positions[:8]}...)."
            )
        return f"the gradient of step {step} holds a NaN or an Inf (attempt {tries}): retrying"

    def exchange(
        self, comm: Communicator, world_size: int, out: list[torch.Tensor], vote: bool
    ) -> tuple[bool, float]:
        """The exact sum of every member's slots into ``out`` (a collective: see
        :class:`~phalanx.train.exact.ExactSum`). Returns (every member voted yes and
        every unit was finite, the summed loss)."""
        terms = [Term(s.buckets, s.loss) for _, s in sorted(self.held.items())]
        got = self.sum.allreduce(comm, terms, out, vote)
        self.nonfinite = got.nonfinite
        return not got.nonfinite and got.votes == world_size, got.loss


class ExactGrads(GradBuffer):
    """A :class:`GradBuffer` whose backward goes to the slot of the unit being
    computed (:meth:`begin` points every ``.grad`` at it, at no copy); the exchange
    writes the exact sum into the buffer's own flats, which ``.grad`` points at
    again from :meth:`end` on."""

    def __init__(self, model: torch.nn.Module, bucket_bytes: int = 25 << 20):
        super().__init__(model, bucket_bytes)
        self.units = Units(self._new_slot)

    def _new_slot(self) -> Slot:
        flats = [torch.zeros_like(f) for f in self.flats]
        return Slot(flats, self.buckets_of(flats), [v for _, v in self.views_of(flats)])

    def begin(self, unit: int) -> None:
        """Before ``unit``'s forward and backward: its gradient goes to a fresh slot."""
        slot = self.units.take(unit)
        for (p, _), v in zip(self.views, slot.views, strict=True):
            p.grad = v

    def end(self, unit: int, loss: float) -> None:
        """After ``unit``'s backward: record its loss."""
        self.units.held[unit].loss = loss
        self.bind()

    def zero(self) -> None:
        self.units.keep(())
        super().zero()

    def allreduce(
        self, comm: Communicator, world_size: int, loss_sum: float, vote: bool = True
    ) -> float:
        """The exact sum of every member's units (``loss_sum`` is not used: each
        unit's loss is summed exactly with it). Sets :attr:`vote_ok`."""
        self.bind()
        self.vote_ok = False
        self.vote_ok, loss = self.units.exchange(comm, world_size, self.buckets, vote)
        return loss


class ExactShardedGrads(ShardedGrads):
    """The same for a rank of a sharded replica: FSDP2 owns ``.grad`` (summed over
    the replica's ranks by its reduce-scatter, a fixed order for a fixed number of
    ranks), so each unit's shard gradient is copied into its slot after the unit's
    backward, and ``.grad`` cleared for the next unit."""

    def __init__(self, model: torch.nn.Module, bucket_bytes: int):
        super().__init__(model, bucket_bytes)
        self.units = Units(self._new_slot)

    def _new_slot(self) -> Slot:
        flats = {k: torch.zeros_like(f) for k, f in self.flats.items()}
        return Slot(list(flats.values()), self.buckets_of(flats), self.views_of(flats))

    def begin(self, unit: int) -> None:
        for p in self.params:
            p.grad = None

    def end(self, unit: int, loss: float) -> None:
        slot = self.units.take(unit, zero=False)
        take_grads(self.params, slot.views)
        slot.loss = loss
        for p in self.params:
            p.grad = None

    def zero(self) -> None:
        self.units.keep(())
        super().zero()

    def allreduce(
        self, comm: Communicator, world_size: int, loss_sum: float, vote: bool = True
    ) -> float:
        self._views = self.views_of(self.flats)
        self.vote_ok = False
        out = self.buckets_of(self.flats)
        self.vote_ok, loss = self.units.exchange(comm, world_size, out, vote)
        return loss

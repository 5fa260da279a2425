"""A replica's share of a step's global batch, and the gradients that hold it.

:meth:`Accumulator.compute` accumulates the gradients of the share that
``(rank, world_size)`` gives the replica. What they already hold of it for the
step (computed ahead of the quorum on a guessed share, or in an attempt whose
exchange failed) is not computed again.

- **Float reduction.** The share is the replica's slice of the samples
  (:func:`~phalanx.train.batch.split`), and its gradients accumulate in place
  in one buffer. If the buffer holds anything outside the new share, or a sum
  (an all-reduce writes in place, even one that fails midway), it is zeroed and
  the whole share computed again.
- **Exact reduction.** The share is a run of *units*, fixed slices of the
  global batch (:mod:`phalanx.train.exact_grads`), split over the replicas by
  the same rule, each unit's gradient in a slot of its own. A changed share
  keeps the units it still has, frees the others and computes the new ones;
  the exchange never writes a slot.

Both split by the quorum's share weights when it carries them (:attr:`Accumulator.
weights`, :func:`~phalanx.train.batch.share_of`): a straggler's share is smaller,
the global batch the same. The time the share's compute took, and its samples, are
what the replica tells the controller with its next quorum request
(:meth:`Accumulator.timing`): the controller finds stragglers from them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from phalanx.data.sampler import ElasticSampler
from phalanx.train.base import Held
from phalanx.train.batch import share_of

Run = Callable[[list[int]], float]
"""``run(positions) -> summed loss``: forward and backward on the samples at those
stream positions, their gradients added to ``.grad``."""


class Accumulator:
    """What one replica's gradients hold for the current step.

    ``unit``: samples per unit in exact mode (the exact buffers'
    :meth:`begin`/:meth:`end` then bracket each unit's run), None for the float
    reduction. Who calls: the replica's manager, from the training thread."""

    def __init__(
        self,
        grads: Any,
        sampler: ElasticSampler | None,
        global_batch_size: int,
        unit: int | None = None,
        slowdown: float = 1.0,
    ):
        if unit is not None and unit < 1:
            raise ValueError(f"an exact unit must hold at least one sample: got {unit}.")
        self.grads, self.sampler = grads, sampler
        self.global_batch_size, self.unit = global_batch_size, unit
        self.held: Held | None = None
        self.weights: tuple[int, ...] = ()
        """The share weights of the replica's last quorum, one per rank (empty: the
        equal split). Set by the manager from each quorum it takes."""
        self.slowdown = slowdown
        """``train.slowdown`` where it names this replica: each run takes this many
        times as long (a throttled device, for tests and bench/ops_straggler.py)."""
        self._timed: tuple[int, float, int] = (-1, 0.0, 0)

    def timing(self) -> tuple[float, int] | None:
        """(seconds, samples) this replica computed for the last step it computed: its
        share's compute time, which its next quorum request reports. None before any."""
        _, seconds, samples = self._timed
        return (seconds, samples) if samples else None

    def _timed_run(self, step: int, run: Run, positions: list[int]) -> float:
        """``run(positions)``, its time added to ``step``'s (and stretched by
        :attr:`slowdown`)."""
        t0 = time.perf_counter()
        loss = run(positions)
        took = time.perf_counter() - t0
        if self.slowdown > 1 and positions:
            time.sleep((self.slowdown - 1) * took)
            took *= self.slowdown
        was, seconds, samples = self._timed
        if was != step:
            seconds, samples = 0.0, 0
        self._timed = (step, seconds + took, samples + len(positions))
        return loss

    def forget(self) -> None:
        """The gradients no longer fit the model (it was healed or reloaded): the
        next :meth:`compute` starts over."""
        self.held = None

    def _sampler(self) -> ElasticSampler:
        if self.sampler is None:
            raise RuntimeError("a share needs the manager's sampler: build the manager with one.")
        return self.sampler

    def share(self, rank: int, world_size: int) -> list[int]:
        """The stream positions of ``(rank, world_size)``'s share of the current batch."""
        if self.unit is not None:
            return [i for _, positions in self.units(rank, world_size) for i in positions]
        s = self._sampler()
        off, count = share_of(self.global_batch_size, world_size, rank, self.weights)
        return s.positions(s.cursor + off, count)

    def units(self, rank: int, world_size: int) -> list[tuple[int, list[int]]]:
        """Exact mode: ``(unit, its stream positions)`` of each unit of the share."""
        if self.unit is None:
            raise RuntimeError("units exist in exact mode only (train.exact_reduction).")
        s, u, b = self._sampler(), self.unit, self.global_batch_size
        off, count = share_of(-(-b // u), world_size, rank, self.weights)
        return [
            (j, s.positions(s.cursor + j * u, min(u, b - j * u))) for j in range(off, off + count)
        ]

    def compute(self, step: int, rank: int, world_size: int, run: Run) -> tuple[float, list[int]]:
        """Bring the gradients to the share of ``(rank, world_size)`` at ``step``,
        computing only what they lack; returns (the share's summed loss, its positions)."""
        if self.unit is not None:
            return self._compute_units(step, rank, world_size, run)
        share = self.share(rank, world_size)
        held = self.held
        if (
            held is None
            or held.step != step
            or not self.grads.local
            or not set(held.indices) <= set(share)
        ):
            self.grads.zero()
            held = self.held = Held(step, [], 0.0)
        have = set(held.indices)
        held.loss += self._timed_run(step, run, [i for i in share if i not in have])
        held.indices = share
        return held.loss, share

    def _compute_units(
        self, step: int, rank: int, world_size: int, run: Run
    ) -> tuple[float, list[int]]:
        if self.held is None or self.held.step != step:
            self.grads.zero()
            self.held = Held(step, [], 0.0)
        mine = self.units(rank, world_size)
        slots = self.grads.units
        slots.keep([j for j, _ in mine])
        for j, positions in mine:
            if j not in slots.held:
                self.grads.begin(j)
                try:
                    loss = self._timed_run(step, run, positions)
                except BaseException:
                    self.held = None  # a unit half computed: start over next time
                    raise
                self.grads.end(j, loss)
        self.held.indices = [i for _, positions in mine for i in positions]
        self.held.loss = slots.loss()
        return self.held.loss, self.held.indices

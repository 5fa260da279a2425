"""When each chaos fault happens and whom it hits: seeded draws, no I/O, no clock
of its own (``now`` is passed in), so that the same seed gives the same faults.

Each kind draws from a stream of its own (``random.Random("SEED:KIND")``): the
times and targets of one kind do not depend on when the others fired. A kind's
next fault is due a time drawn uniformly in [P/2, 3P/2] after its previous one
(P its ``*-every``), the first one that long after :meth:`Schedule.__init__`. A
fault that is due but cannot be delivered yet (a replica is down, the controller
is restarting) stays due: the launcher asks again on its next pass, and the next
draw counts from when it was delivered (:meth:`Schedule.fired`).

``all-every`` is one more stream, ``all``: when its fault is due, its kind is drawn
(:meth:`Schedule.draw_kind`) and kept until that fault is delivered, and its target
is then drawn from the drawn kind's own stream, as that kind's would be.

Who calls: the launcher's chaos runner (:mod:`phalanx.launch.chaos.runner`), from
its loop and its slow thread; not thread-safe by itself (the runner calls each
stream from one thread: the slow stream only from the slow thread's start).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TypeVar

from phalanx.launch.chaos.spec import ALL_KIND, KINDS, Chaos

T = TypeVar("T")


class Schedule:
    def __init__(self, spec: Chaos, now: float):
        self.spec = spec
        self.periods = spec.periods()
        self.rngs = {k: random.Random(f"{spec.seed}:{k}") for k in (*KINDS, ALL_KIND)}
        self.next_at = {k: now + self._gap(k) for k in self.periods}
        self.drawn: str | None = None
        """The kind of the ``all`` fault that is due and not yet delivered."""

    def _gap(self, kind: str) -> float:
        p = self.periods[kind]
        return self.rngs[kind].uniform(0.5 * p, 1.5 * p)

    def due(self, now: float) -> list[str]:
        """The kinds whose next fault is due at ``now``, earliest first."""
        return sorted(
            (k for k, t in self.next_at.items() if t <= now), key=self.next_at.__getitem__
        )

    def fired(self, kind: str, now: float) -> None:
        """A fault of ``kind`` was delivered at ``now``: draw when its next one is due."""
        self.next_at[kind] = now + self._gap(kind)
        if kind == ALL_KIND:
            self.drawn = None

    def draw_kind(self, kinds: Sequence[str]) -> str:
        """The kind of the ``all`` fault that is due, among ``kinds`` (those the job can
        take, in :data:`KINDS` order): drawn once, then the same until it is
        :meth:`fired`, so that a kind that cannot land yet is not redrawn away."""
        if self.drawn is None:
            self.drawn = self.rngs[ALL_KIND].choice(list(kinds))
        return self.drawn

    def slow_for(self) -> float:
        """How long a drawn ``slow`` lasts: uniform in [slow-for/2, slow-for]."""
        s = self.spec.slow_for_s
        return self.rngs["slow"].uniform(0.5 * s, s)

    def pick(self, kind: str, options: Sequence[T]) -> T:
        """The target of a fault of ``kind`` among ``options`` (in a stable order: the
        caller sorts them, so that the same seed hits the same names)."""
        return self.rngs[kind].choice(list(options))

    def stop_for(self) -> float:
        """How long the next ``stop`` lasts: uniform in [stop-for/2, stop-for]."""
        s = self.spec.stop_for_s
        return self.rngs["stop"].uniform(0.5 * s, s)

    def partition_for(self) -> float:
        """How long the next ``partition`` lasts: uniform in [partition-for/2, partition-for]."""
        s = self.spec.partition_for_s
        return self.rngs["partition"].uniform(0.5 * s, s)

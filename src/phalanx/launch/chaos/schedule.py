"""When each chaos fault happens and whom it hits: seeded draws, no I/O, no clock
of its own (``now`` is passed in), so that the same seed gives the same faults.

Each kind draws from a stream of its own (``random.Random("SEED:KIND")``): the
times and targets of one kind do not depend on when the others fired. A kind's
next fault is due a time drawn uniformly in [P/2, 3P/2] after its previous one
(P its ``*-every``), the first one that long after :meth:`Schedule.__init__`. A
fault that is due but cannot be delivered yet (a replica is down, the controller
is restarting) stays due: the launcher asks again on its next pass, and the next
draw counts from when it was delivered (:meth:`Schedule.fired`).

Who calls: the launcher's chaos runner (:mod:`phalanx.launch.chaos.runner`), from
its loop and its slow thread; not thread-safe by itself (the runner calls each
stream from one thread: the slow stream only from the slow thread's start).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TypeVar

from phalanx.launch.chaos.spec import Chaos

T = TypeVar("T")


class Schedule:
    def __init__(self, spec: Chaos, now: float):
        self.spec = spec
        self.periods = spec.periods()
        self.rngs = {k: random.Random(f"{spec.seed}:{k}") for k in (*self.periods, "slow")}
        self.next_at = {k: now + self._gap(k) for k in self.periods}

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

    def pick(self, kind: str, options: Sequence[T]) -> T:
        """The target of a fault of ``kind`` among ``options`` (in a stable order: the
        caller sorts them, so that the same seed hits the same names)."""
        return self.rngs[kind].choice(list(options))

    def stop_for(self) -> float:
        """How long the next ``stop`` lasts: uniform in [stop-for/2, stop-for]."""
        s = self.spec.stop_for_s
        return self.rngs["stop"].uniform(0.5 * s, s)

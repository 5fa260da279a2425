"""How long a replica sits idle: the fraction of its wall time spent waiting for
work rather than doing it.

An RL job's two sides wait on each other. The policy waits for rollouts (its
batch lease long-poll); a rollout replica waits for prompts (its lease
long-poll) and for weights (a sync order it takes part in). The asynchronous
loop exists to keep both busy, so these fractions are what it is judged by: a
policy idle half its steps is starved of rollouts (add rollout replicas, or
allow more staleness), rollout replicas idle half their batches outrun the
policy.

:class:`IdleClock` is a two-state stopwatch. The loop says when it starts
waiting (:meth:`~IdleClock.wait`) and when it starts working again
(:meth:`~IdleClock.work`); any number of independent windows then read the
idle fraction since their own last reading (:meth:`~IdleClock.lap`): the
policy reads one per committed step (its ``step`` line) and one per
acknowledged batch (:class:`~phalanx.protocol.rl.BatchMetrics`, which may span
``grpo.inner_epochs`` steps). One thread drives a clock; it does no I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class IdleClock:
    """Accumulates the seconds spent waiting, and reads them as fractions of wall time.

    Starts working, at construction. ``clock`` is a monotonic time in seconds
    (``time.perf_counter`` by default; tests pass their own).
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.waited_s = 0.0
        """Seconds spent waiting since construction, up to the last state change."""
        self.waiting_since: float | None = None
        """When the current wait began; None while working."""
        self.marks: dict[str, tuple[float, float]] = {}
        """Per window: (the time of its last lap, :meth:`total` then)."""
        self.started = clock()

    def wait(self) -> None:
        """From now on, the caller waits for work (a no-op if it already does)."""
        if self.waiting_since is None:
            self.waiting_since = self.clock()

    def work(self) -> None:
        """From now on, the caller works (a no-op if it already does)."""
        if self.waiting_since is not None:
            self.waited_s += self.clock() - self.waiting_since
            self.waiting_since = None

    def total(self, now: float) -> float:
        """Seconds waited from construction to ``now``, the current wait included."""
        open_s = now - self.waiting_since if self.waiting_since is not None else 0.0
        return self.waited_s + open_s

    def lap(self, window: str = "step") -> float:
        """The idle fraction of ``window`` since its last lap (the first: since the
        clock was made), in [0, 1], rounded to 4 places; starts the window anew. A
        wait in progress is split at the lap: its part so far counts here, the rest
        in the next lap. A window of no wall time reads 0."""
        now = self.clock()
        t0, w0 = self.marks.get(window, (self.started, 0.0))
        waited = self.total(now)
        self.marks[window] = (now, waited)
        wall = now - t0
        if wall <= 0:
            return 0.0
        return round(min(1.0, max(0.0, (waited - w0) / wall)), 4)

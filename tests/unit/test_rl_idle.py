"""The idle clock (rl/idle.py) on a clock the test moves: waits add up, laps read
each window's share since its own last lap, and a wait in progress is split."""

from __future__ import annotations

from phalanx.rl.idle import IdleClock


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def test_waits_over_wall_time_per_lap():
    c = Clock()
    idle = IdleClock(c)
    c.advance(1.0)  # working
    idle.wait()
    c.advance(3.0)  # waiting for a batch
    idle.work()
    c.advance(4.0)
    assert idle.lap() == 0.375  # 3 s of 8
    assert idle.lap() == 0.0  # no wall time since
    idle.wait()
    idle.wait()  # already waiting: the wait began at the first call
    c.advance(2.0)
    idle.work()
    idle.work()  # already working: nothing more added
    c.advance(2.0)
    assert idle.lap() == 0.5
    assert idle.waited_s == 5.0


def test_a_wait_in_progress_is_split_at_the_lap():
    c = Clock()
    idle = IdleClock(c)
    idle.wait()
    c.advance(2.0)
    assert idle.lap() == 1.0  # the whole window was spent waiting
    c.advance(1.0)
    idle.work()
    c.advance(3.0)
    assert idle.lap() == 0.25  # the rest of that wait: 1 s of 4


def test_windows_are_independent():
    """The policy's step window laps every step; its batch window laps at each ack,
    over every step of the batch (grpo.inner_epochs > 1)."""
    c = Clock()
    idle = IdleClock(c)
    idle.wait()
    c.advance(6.0)  # the batch's lease
    idle.work()
    c.advance(4.0)
    assert idle.lap("step") == 0.6  # step 1: leased and trained
    c.advance(10.0)
    assert idle.lap("step") == 0.0  # step 2: the same batch again, no lease
    assert idle.lap("batch") == 0.3  # the batch: 6 s of its 20


def test_no_wall_time_reads_zero():
    c = Clock()
    assert IdleClock(c).lap() == 0.0

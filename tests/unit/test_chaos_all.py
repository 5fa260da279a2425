"""``--chaos all-every=S``, the soak's faults: one fault every S on average, its kind
drawn among every kind the job can take, seeded; a drawn ``slow`` throttles a drawn
replica for a drawn time and then lets it go (``sleep`` children stand in for the
replicas, as in test_chaos.py: the actions only signal them)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from phalanx.config import JobConfig
from phalanx.launch.chaos.log import read
from phalanx.launch.chaos.runner import ChaosRunner, drawable
from phalanx.launch.chaos.schedule import Schedule
from phalanx.launch.chaos.spec import Chaos
from phalanx.launch.local import LocalJob
from phalanx.launch.procs import spawn, stop_all


def test_all_every_parses_with_the_kinds_options():
    c = Chaos.parse("all-every=15,restart-after=1,stop-for=3,slow-cycle=0.5,slow-for=6,seed=4")
    assert c.periods() == {"all": 15.0} and c.kinds() == ["all"]
    assert (c.restart_after_s, c.stop_for_s, c.slow_cycle_s, c.slow_for_s, c.seed) == (
        1.0, 3.0, 0.5, 6.0, 4,
    )  # fmt: skip
    assert Chaos.parse("all-every=15").slow_for_s == 10.0


def drawn(seed: int, kinds: list[str], fails: set[int] = frozenset(), n: int = 200) -> list[str]:
    """The kinds of ``n`` faults drawn on a simulated clock; the faults numbered in
    ``fails`` cannot land on their first try."""
    s, out, now, tries = Schedule(Chaos.parse(f"all-every=15,seed={seed}"), 0.0), [], 0.0, 0
    while len(out) < n:
        now += 1.0
        if s.due(now) != ["all"]:
            continue
        kind = s.draw_kind(kinds)
        tries += 1
        if len(out) in fails and tries == 1:
            continue  # stays due: the same kind is asked for again
        tries = 0
        out.append(kind)
        s.fired("all", now)
    return out


def test_all_every_draws_every_kind_seeded_and_keeps_a_draw_until_it_lands():
    kinds = ["kill", "stop", "controller-kill", "engine-kill", "slow"]
    a = drawn(3, kinds)
    assert a == drawn(3, kinds) and a != drawn(4, kinds)
    assert set(a) == set(kinds) and max(a.count(k) for k in kinds) < 80
    assert drawn(3, kinds, fails={5, 17}) == a  # a fault that waits is not redrawn away


def test_the_kinds_drawn_are_those_the_job_can_take(tmp_path: Path):
    ft = LocalJob(None, JobConfig(), tmp_path / "ft", [], {"policy": 2})
    assert drawable(ft) == ["kill", "stop", "slow"]  # no controller started here
    rl = JobConfig.model_validate({"rl": {}, "roles": {"policy": {}, "rollout": {}}})
    job = LocalJob(None, rl, tmp_path / "rl", [], {"policy": 1, "rollout": 1})
    assert drawable(job) == ["kill", "stop", "engine-kill", "slow"]


def state_of(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def wait_state(pid: int, want: str) -> None:
    deadline = time.monotonic() + 10
    while state_of(pid) != want:
        assert time.monotonic() < deadline, f"pid {pid} never reached state {want}"
        time.sleep(0.01)


def test_a_drawn_slow_throttles_its_replica_for_its_time_then_lets_it_go(tmp_path: Path):
    job = LocalJob(None, JobConfig(), tmp_path, [], {"policy": 2})
    for r in job.replicas.values():
        r.proc = spawn(["sleep", "60"], tmp_path / f"{r.name}.log", subprocess.DEVNULL)
        r.progress = True
    job.finished = lambda: False  # type: ignore[method-assign]
    run = ChaosRunner(Chaos.parse("all-every=100,slow-cycle=0.1,slow-for=1,seed=1"), job)
    try:
        run.start()
        run.sched.drawn = "slow"  # (the draw itself is test_all_every_draws_...)
        run.sched.next_at["all"] = 0.0
        run.tick()
        assert run.slow_target in job.replicas and run.sched.drawn is None
        pid = job.replicas[run.slow_target].proc.pid  # type: ignore[union-attr]
        wait_state(pid, "T")  # a duty cycle: stopped, running, stopped
        wait_state(pid, "S")
        wait_state(pid, "T")
        (line,) = read(job.run_dir)
        assert line["kind"] == "slow" and line["pid"] == pid
        assert 0.5 <= line["detail"]["slow_s"] <= 1.0
        deadline = time.monotonic() + 10
        while run.slow_target is not None:  # its time is over: no longer slowed
            assert time.monotonic() < deadline
            time.sleep(0.05)
        wait_state(pid, "S")
        assert any("its slow is over" in e for e in job.events)
    finally:
        run.close()
        stop_all([r.proc for r in job.replicas.values()], grace_s=2)

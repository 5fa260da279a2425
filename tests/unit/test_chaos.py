"""``--chaos``: the grammar, the seeded schedule, the checks that refuse a fault the
job cannot take, and the fault actions on real processes (``sleep`` children in
sessions of their own, standing in for replicas: the actions only signal them)."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from phalanx.config import JobConfig
from phalanx.launch.chaos import faults
from phalanx.launch.chaos.log import ChaosLog, read
from phalanx.launch.chaos.runner import ChaosRunner, check
from phalanx.launch.chaos.schedule import Schedule
from phalanx.launch.chaos.spec import Chaos
from phalanx.launch.local import LocalJob
from phalanx.launch.procs import spawn, stop_all

# -- the grammar ----------------------------------------------------------------


def test_kill_every_parses_as_it_always_did():
    c = Chaos.parse("kill-every=10,restart-after=1.5,seed=3")
    assert (c.kill_every_s, c.restart_after_s, c.seed) == (10.0, 1.5, 3)
    assert Chaos.parse("kill-every=2").restart_after_s == 2.0
    assert c.kinds() == ["kill"]


def test_several_kinds_combine_in_one_value():
    c = Chaos.parse(
        "kill-every=20,stop-every=30,stop-for=4,controller-kill-every=40,"
        "engine-kill-every=50,slow=rollout:0.25,slow-cycle=2,seed=3"
    )
    assert c.periods() == {"kill": 20, "stop": 30, "controller-kill": 40, "engine-kill": 50}
    assert (c.stop_for_s, c.slow, c.slow_fraction, c.slow_cycle_s) == (4, "rollout", 0.25, 2)
    assert c.kinds() == ["kill", "stop", "controller-kill", "engine-kill", "slow"]
    assert Chaos.parse("slow=policy-1").slow_fraction == 0.5
    assert Chaos.parse("partition-every=9,partition-for=3").partition_for_s == 3


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("kill-every", "key=value"),
        ("every=3", "no kind or option 'every'"),
        ("explode-every=3", "no kind or option 'explode-every'"),
        ("kill-every=x", "kill-every must be a number of seconds > 0"),
        ("kill-every=0", "kill-every must be a number of seconds > 0"),
        ("kill-every=inf", "kill-every must be a number of seconds > 0"),
        ("kill-every=1,foo=2", "no kind or option 'foo'"),
        ("seed=3", "at least one fault kind"),
        ("kill-every=1,stop-for=2", "stop-for goes with stop-every"),
        ("stop-every=1,restart-after=2", "restart-after goes with kill-every or engine-kill"),
        ("kill-every=1,kill-every=2", "kill-every once"),
        ("kill-every=1,restart-after=-1", "restart-after must be a number of seconds >= 0"),
        ("kill-every=1,seed=x", "seed must be a whole number"),
        ("slow=policy-0:1.5", "slow's fraction"),
        ("slow=:0.5", "slow must name a replica or a role"),
        # all-every, the soak's faults (test_chaos_all.py)
        ("all-every=0", "all-every must be a number of seconds > 0"),
        ("all-every=x", "all-every must be a number of seconds > 0"),
        ("all-every=5,kill-every=2", "all-every draws from every kind itself, so it goes alone"),
        ("all-every=5,slow=policy-1", "got it with slow"),
        ("kill-every=5,slow-for=3", "slow-for goes with all-every"),
        ("kill-every=5,partition-for=3", "partition-for goes with partition-every or all-every"),
        ("mix-every=5", "no kind or option 'mix-every'"),
    ],
)
def test_bad_chaos_is_one_line_naming_what_is_wrong(text: str, says: str):
    with pytest.raises(ValueError, match="--chaos") as e:
        Chaos.parse(text)
    assert says in str(e.value) and "\n" not in str(e.value)


# -- the seeded schedule --------------------------------------------------------


def faults_drawn(seed: int, names: list[str], passes: int = 400) -> list[tuple[float, str, str]]:
    """Run a schedule on a simulated clock (0.1 s passes), every due fault delivered."""
    spec = Chaos.parse(f"kill-every=2,stop-every=3,engine-kill-every=5,seed={seed}")
    s, out = Schedule(spec, 0.0), []
    for i in range(passes):
        now = i * 0.1
        for kind in s.due(now):
            out.append((round(now, 1), kind, s.pick(kind, names)))
            s.fired(kind, now)
    return out


def test_the_same_seed_draws_the_same_faults():
    names = ["policy-0", "policy-1", "rollout-0"]
    a, b = faults_drawn(7, names), faults_drawn(7, names)
    assert a == b and len(a) > 20
    assert faults_drawn(8, names) != a
    assert {k for _, k, _ in a} == {"kill", "stop", "engine-kill"}
    kills = [t for t, k, _ in a if k == "kill"]
    gaps = [y - x for x, y in itertools.pairwise(kills)]
    assert all(0.9 <= g <= 3.1 for g in gaps) and len(set(gaps)) > 1  # drawn in [P/2, 3P/2]
    assert len({n for _, _, n in a}) == 3


def test_a_kinds_draws_do_not_depend_on_the_others():
    names = ["policy-0", "policy-1"]
    alone = Schedule(Chaos.parse("kill-every=2,seed=1"), 0.0)
    mixed = Schedule(Chaos.parse("kill-every=2,stop-every=1,seed=1"), 0.0)
    assert alone.next_at["kill"] == mixed.next_at["kill"]
    mixed.pick("stop", names)
    mixed.fired("stop", 1.0)
    assert [alone.pick("kill", names) for _ in range(5)] == [
        mixed.pick("kill", names) for _ in range(5)
    ]


# -- what the job must have -----------------------------------------------------


def rl_cfg() -> JobConfig:
    return JobConfig.model_validate({"rl": {}, "roles": {"policy": {}, "rollout": {}}})


def test_a_fault_the_job_cannot_take_is_one_line():
    ft = JobConfig()
    with pytest.raises(ValueError, match="engine-kill-every needs a job with rollout replicas"):
        check(Chaos.parse("engine-kill-every=5"), ft, {"policy": 2})
    with pytest.raises(ValueError, match="engine-kill-every needs"):
        check(Chaos.parse("engine-kill-every=5"), rl_cfg(), {"policy": 1, "rollout": 0})
    check(Chaos.parse("engine-kill-every=5"), rl_cfg(), {"policy": 1, "rollout": 1})
    with pytest.raises(ValueError, match=r"slow must name a replica \(policy-0, policy-1\)"):
        check(Chaos.parse("slow=policy-2"), ft, {"policy": 2})
    check(Chaos.parse("slow=policy-1"), ft, {"policy": 2})
    check(Chaos.parse("slow=policy"), ft, {"policy": 2})
    # (partition-every, refused without root or nftables: tests/unit/test_chaos_partition.py)


# -- the actions, on real processes ---------------------------------------------


def state_of(pid: int) -> str:
    """The process's state letter (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def wait_state(pid: int, want: str) -> None:
    deadline = time.monotonic() + 10
    while state_of(pid) != want:
        assert time.monotonic() < deadline, f"pid {pid} never reached state {want}"
        time.sleep(0.01)


@pytest.fixture
def job(tmp_path: Path):
    """A launcher of an RL job whose three replicas are ``sleep`` processes."""
    j = LocalJob(None, rl_cfg(), tmp_path, [], {"policy": 1, "rollout": 2})
    for r in j.replicas.values():
        r.proc = spawn(["sleep", "60"], tmp_path / f"{r.name}.log", subprocess.DEVNULL)
    yield j
    stop_all([r.proc for r in j.replicas.values()], grace_s=2)


def test_a_kill_waits_for_every_replica_to_progress(job: LocalJob):
    sched, log = (
        Schedule(Chaos.parse("kill-every=1,restart-after=0"), 0.0),
        ChaosLog(job.run_dir, job.note),
    )
    job.replicas["policy-0"].progress = job.replicas["rollout-0"].progress = True
    assert not faults.kill(job, sched, log, set())  # rollout-1 has not submitted yet
    job.replicas["rollout-1"].progress = True
    assert not faults.kill(job, sched, log, {"rollout-1"})  # one is stopped
    assert faults.kill(job, sched, log, set())
    (victim,) = [r for r in job.replicas.values() if r.kills]
    assert victim.proc is None and victim.restart_at is not None
    assert not faults.kill(job, sched, log, set())  # one is down: wait for it to come back
    (line,) = read(job.run_dir)
    assert line["kind"] == "kill" and line["target"] == victim.name and line["pid"] > 0
    assert set(line) == {"t", "kind", "target", "pid", "detail"}
    assert any(f"chaos: SIGKILL {victim.name}" in e for e in job.events)


def test_a_stopped_replica_is_continued_at_its_end_and_at_close(job: LocalJob):
    for r in job.replicas.values():
        r.progress = True
    run = ChaosRunner(Chaos.parse("stop-every=0.01,stop-for=0.2,seed=2"), job)
    job.finished = lambda: False  # type: ignore[method-assign]
    deadline = time.monotonic() + 10
    while not run.stopped:
        assert time.monotonic() < deadline
        run.tick()
        time.sleep(0.01)
    (name,) = run.stopped
    pid = job.replicas[name].proc.pid  # type: ignore[union-attr]
    wait_state(pid, "T")
    run.sched.next_at["stop"] = float("inf")  # (no next stop yet)
    while run.stopped:  # its stop is over: continued by a pass
        assert time.monotonic() < deadline
        run.tick()
        time.sleep(0.01)
    wait_state(pid, "S")
    run.sched.next_at["stop"] = 0.0
    run.tick()  # continued, it may have been evicted: down until it moves on
    assert not run.stopped and name in run.rejoining
    r = job.replicas[name]
    r.step, r.rollouts = r.step + 1, r.rollouts + 1
    run.tick()  # another stop, ended by close (the run ends before it does)
    (name,) = run.stopped
    pid = job.replicas[name].proc.pid  # type: ignore[union-attr]
    wait_state(pid, "T")
    run.close()
    wait_state(pid, "S")
    assert not run.stopped
    lines = read(job.run_dir)
    assert [x["kind"] for x in lines] == ["stop", "stop"]
    assert 0.1 <= lines[0]["detail"]["stop_s"] <= 0.2


def test_slow_stops_its_replica_part_of_each_cycle_and_never_leaves_it_stopped(job: LocalJob):
    for r in job.replicas.values():
        r.progress = True
    job.finished = lambda: False  # type: ignore[method-assign]
    run = ChaosRunner(Chaos.parse("slow=rollout:0.5,slow-cycle=0.2,seed=4"), job)
    run.start()
    assert run.slow_target in ("rollout-0", "rollout-1")
    pid = job.replicas[run.slow_target].proc.pid  # type: ignore[union-attr]
    wait_state(pid, "T")  # stopped, then running again: a duty cycle
    wait_state(pid, "S")
    wait_state(pid, "T")
    run.close()
    wait_state(pid, "S")
    (line,) = read(job.run_dir)
    assert line["kind"] == "slow" and line["target"] == run.slow_target and line["pid"] == pid
    assert line["detail"] == {"fraction": 0.5, "cycle_s": 0.2}


def test_engine_workers_are_the_replicas_children(tmp_path: Path):
    p = spawn(["sh", "-c", "sleep 30 & sleep 30 & wait"], tmp_path / "x.log", subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while len(faults.engine_workers(p.pid)) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        kids = faults.engine_workers(p.pid)
        assert all(
            json.loads(Path(f"/proc/{k}/stat").read_text().split()[3]) == p.pid for k in kids
        )
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    assert faults.engine_workers(p.pid) == []

"""FT data parallel end to end: a real controller, real ``phalanx replica``
processes of the built-in job (CPU, gloo), real SIGKILL / SIGSTOP.

Every scenario checks the same invariants (:func:`check_run`):

- every step 1..N committed once, and all replicas that committed a step agree
  on it (quorum, participants, cursor, loss);
- exactly-once data: the shares of a step's participants concatenate to that
  step's global batch, and the steps to the sampler's stream;
- every replica ends with bit-identical model and optimizer state;
- that state equals a failure-free run's to 1e-9 (float64): failures, joins
  and the split over replicas do not change the numbers.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from ftjob import (
    TRAIN,
    FTJob,
    Proc,
    Replica,
    assert_close,
    assert_identical,
    assert_same_files,
    audit_job,
    cleanup_jobs,
    step_lines,
    write_job,
)

STEPS = 40
BATCH = TRAIN["global_batch_size"]
DATASET = TRAIN["dataset_size"]
SEED = 7  # ftjob.write_job's job.seed
ATOL = 1e-9

MakeJob = Callable[..., FTJob]


def _job(root: Path, name: str, jobs: list[FTJob], **kw: Any) -> FTJob:
    d = root / name
    d.mkdir()
    kw.setdefault("train", {})
    kw["train"] = {"steps": STEPS, **kw["train"]}
    job = FTJob(d, write_job(d / "job.toml", job_id=name, **kw))
    jobs.append(job)
    return job


@pytest.fixture
def make_job(tmp_path: Path) -> Iterator[MakeJob]:
    """``make_job(name, train=..., policy=..., timeouts=...)``: a job dir with its
    TOML; every process started through it is killed at teardown."""
    jobs: list[FTJob] = []
    try:
        yield lambda name="job", **kw: _job(tmp_path, name, jobs, **kw)
    finally:
        cleanup_jobs(jobs)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    """Final states of failure-free runs with 3 replicas and with 1 (run side by
    side, unpaced). Keys ``"3"`` and ``"1"``."""
    root = tmp_path_factory.mktemp("reference")
    jobs: list[FTJob] = []
    try:
        runs: dict[str, tuple[FTJob, list[Replica]]] = {}
        for n in (3, 1):
            job = _job(root, f"ref{n}", jobs, policy={"n_init_replicas": n})
            job.start_controller()
            runs[str(n)] = (job, [job.start_replica(f"r{i}") for i in range(n)])
        out = {}
        for n, (job, replicas) in runs.items():
            finals = [r.finish() for r in replicas]
            assert_identical(finals)
            assert_same_files(replicas, STEPS)  # the calm run's files: byte for byte
            audit_job(job, STEPS)
            lines = step_lines(replicas)
            assert {e["participants"] for by_id in lines.values() for e in by_id.values()} == {
                int(n)
            }
            out[n] = finals[0]
        yield out
    finally:
        cleanup_jobs(jobs, exit_grace_s=15.0)


def check_run(
    job: FTJob, replicas: list[Replica], finals: list[dict[str, Any]], reference: dict[str, Any]
) -> dict[int, dict[str, dict[str, Any]]]:
    """The invariants every scenario must keep (see the module docstring): the product
    audit of the job, and the final states. Returns ``replicas``' step lines."""
    audit_job(job, STEPS)
    lines = step_lines(replicas)
    assert_identical(finals)
    assert_same_files(replicas, STEPS)
    worst = assert_close(finals[0], reference, ATOL)
    print(f"largest difference from the failure-free run: {worst:.3g}")
    return lines


def assert_job_finished(job: FTJob) -> None:
    """Once its replicas have left, the controller knows the job's final step, so
    that a replica started now finds the job finished instead of training it
    again from scratch."""
    deadline = time.monotonic() + 30
    while (policy := job.status()["roles"]["policy"])["replicas"]:
        assert time.monotonic() < deadline, policy["replicas"]
        time.sleep(0.05)
    assert policy["step"] == STEPS, policy


def gap(p: Proc, step: int) -> float:
    """Seconds between ``p``'s step lines ``step - 1`` and ``step``."""
    at = {e["step"]: e["_at"] for e in p.steps()}
    return at[step] - at[step - 1]


def first_step(p: Proc) -> dict[str, Any]:
    return p.steps()[0]


# -- 1 and 5: kill and restart ---------------------------------------------------


@dataclass
class KillRestart:
    job: FTJob
    survivors: list[Replica]
    victim: Replica
    restarted: Replica
    finals: list[dict[str, Any]] = field(default_factory=list)
    killed_at: int = 0
    restarted_at: int = 0


KILL_AT, RESTART_AT = 20, 22

KILL_TIMEOUTS = {"heartbeat_s": 10.0, "suspect_grace_s": 1.0}
"""For the kill tests: a SIGKILLed peer is found by the survivors' failed collective
and cannot answer the probe, so these do not slow its eviction; they keep a live
replica on a loaded machine from being taken for dead (a missed heartbeat or probe)."""


@pytest.fixture(scope="module")
def kill_restart(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KillRestart]:
    """3 replicas; SIGKILL one when it reports step 20; restart it (same name) when
    the survivors report step 22, once they train without it. Paced so that the 18
    steps left take seconds however fast the machine is."""
    jobs: list[FTJob] = []
    try:
        job = _job(
            tmp_path_factory.mktemp("kill"),
            "kill",
            jobs,
            policy={"n_init_replicas": 3},
            train={"step_delay_s": 0.1},
            timeouts=KILL_TIMEOUTS,
        )
        job.start_controller()
        a, b, c = (job.start_replica(n) for n in "abc")
        # The restart is a warm spare (see ftjob.SPARE): a cold start takes longer
        # on a loaded 2-core machine than the survivors need to finish the job.
        restart = job.start_replica("c", spare=True)
        c.wait_step(KILL_AT)
        c.kill()
        a.wait_step(RESTART_AT)
        restart.release()
        run = KillRestart(job, [a, b], c, restart)
        run.killed_at = c.steps()[-1]["step"]
        run.restarted_at = a.steps()[-1]["step"]
        run.finals = [r.finish() for r in (a, b, run.restarted)]
        assert_job_finished(job)
        yield run
    finally:
        cleanup_jobs(jobs, exit_grace_s=15.0)


def test_kill_and_restart(kill_restart: KillRestart, reference: dict[str, dict[str, Any]]):
    run = kill_restart
    a = run.survivors[0]
    lines = check_run(
        run.job, [*run.survivors, run.victim, run.restarted], run.finals, reference["3"]
    )
    assert run.killed_at == KILL_AT
    # The survivors kept committing while the victim was down.
    for step in range(1, run.killed_at + 1):
        assert {e["participants"] for e in lines[step].values()} == {3}, step
    for step in range(run.killed_at + 1, run.restarted_at + 1):
        assert {e["participants"] for e in lines[step].values()} == {2}, step
    # The restarted incarnation healed on its first step and took part from then on.
    first = first_step(run.restarted)
    assert first["replica"] != run.victim.steps()[0]["replica"]
    assert first["healed"] is True and first["participants"] == 3, first
    assert first["step"] > run.restarted_at
    for step in range(first["step"], STEPS + 1):
        assert {e["participants"] for e in lines[step].values()} == {3}, step
    # A constant global batch: 1 replica and 3 replicas train the same numbers.
    print(f"1 vs 3 replicas: {assert_close(reference['1'], reference['3'], ATOL):.3g}")
    print(
        f"kill/restart: stall at kill {gap(a, run.killed_at + 1):.2f} s, "
        f"at rejoin {gap(a, first['step']):.2f} s; rejoined at step {first['step']}"
    )


def test_data_exactly_once(kill_restart: KillRestart):
    """Across a kill and a restart: every committed step's global batch was trained
    exactly once, split among the replicas that committed it."""
    run = kill_restart
    audit_job(run.job, STEPS)
    lines = step_lines([*run.survivors, run.victim, run.restarted])
    # The victim's lines stop where it died; its restarted incarnation has no step
    # before it healed: no step was trained twice by one name.
    by_name: dict[str, list[int]] = {}
    for step, by_id in lines.items():
        for rid in by_id:
            by_name.setdefault(rid.split(":")[0], []).append(step)
    for name, steps in by_name.items():
        assert len(steps) == len(set(steps)), name
    assert by_name["c"] == sorted(by_name["c"])
    assert len(by_name["a"]) == len(by_name["b"]) == STEPS


# -- 2: late joiner ----------------------------------------------------------------


def test_late_joiner(make_job: MakeJob, reference: dict[str, dict[str, Any]]):
    # Nobody fails here: timeouts a loaded machine meets, so that no live replica is
    # taken for dead (a missed probe) and the heal is not cut short by the collective's.
    # Every quorum forms once all live replicas asked, never at the join timeout: a
    # replica SIGSTOPped below before it asked is a straggler to the controller, and
    # at the 1 s default the others' quorum would leave it out. (Seen in CI: step 6
    # with 2 participants, most likely from the other way a hold split them, since
    # fixed in the communicator: resumed first, a waiter gave a peer 0.5 s to resume.)
    job = make_job(
        policy={"n_init_replicas": 3, "join_timeout_s": 600.0},
        train={"step_delay_s": 0.02},
        timeouts={**KILL_TIMEOUTS, "collective_s": 5.0, "heartbeat_s": 60.0, "quorum_s": 120.0},
    )
    job.start_controller()
    first = [job.start_replica(n) for n in "abc"]
    d = job.start_replica("d", spare=True)
    first[0].wait_step(5)
    # The three are held (SIGSTOP) until d has registered, so that they cannot
    # finish the job first on a loaded machine (seen: d's start took longer than
    # their 35 remaining steps). A quorum waits for them: they hold newer steps.
    for r in first:
        r.signal(signal.SIGSTOP)
    try:
        d.release()
        deadline = time.monotonic() + 240
        while not any(
            m["replica_id"].startswith("d:") for m in job.status()["roles"]["policy"]["replicas"]
        ):
            assert time.monotonic() < deadline, "d never registered"
            time.sleep(0.05)
    finally:
        for r in first:
            r.signal(signal.SIGCONT)
    joined = d.wait_step(1)
    finals = [r.finish() for r in [*first, d]]
    lines = check_run(job, [*first, d], finals, reference["3"])
    assert joined["healed"] is True and joined["participants"] == 4, joined
    assert joined["step"] > 5
    for step in range(1, joined["step"]):
        assert {e["participants"] for e in lines[step].values()} == {3}, step
    for step in range(joined["step"], STEPS + 1):
        assert {e["participants"] for e in lines[step].values()} == {4}, step
    assert_job_finished(job)
    # The heal is on the controller's timeline, with its time and its source.
    healed = [e for e in job.status()["overview"]["timeline"] if e["kind"] == "healed"]
    assert [e["replica_id"].split(":")[0] for e in healed] == ["d"], healed
    h = healed[0]
    assert h["source"].split(":")[0] in "abc" and h["step"] == joined["step"] - 1, h
    assert 0 < h["seconds"] < 30 and h["text"].startswith(f"{h['replica_id']} healed from "), h


# -- 3: hang (SIGSTOP), eviction, comeback as a new incarnation ---------------------


def test_hang_evict_and_come_back(make_job: MakeJob, reference: dict[str, dict[str, Any]]):
    job = make_job(policy={"n_init_replicas": 3}, train={"step_delay_s": 0.03})
    job.start_controller()
    a, b, c = (job.start_replica(n) for n in "abc")
    old_id = b.wait_step(10)["replica"]
    # On a loaded host a replica may be evicted as it starts (and come back at once):
    # only the evictions from the hang on are this scenario's.
    before = max((e["seq"] for e in job.status()["events"]), default=0)
    b.signal(signal.SIGSTOP)
    stopped_at = b.steps()[-1]["step"]  # a lower bound: a line may still be in the pipe
    # The survivors go on without it: at once if it hung between steps (it is left
    # out of the next quorum after join_timeout_s), else when their collective times
    # out and they report it.
    a.wait_event(
        lambda e: e["event"] == "step" and e["participants"] == 2 and e["step"] >= stopped_at + 3,
        "3 steps committed by the 2 survivors",
    )
    # It stays stopped until the controller has evicted it (no heartbeat within
    # heartbeat_s), so that it must come back as a new incarnation.
    deadline = time.monotonic() + 30
    while old_id in {m["replica_id"] for m in job.status()["roles"]["policy"]["replicas"]}:
        assert time.monotonic() < deadline, f"{old_id} was never evicted"
        time.sleep(0.05)
    evicted = [e for e in job.status()["events"] if e["kind"] == "evict" and e["seq"] > before]
    b.signal(signal.SIGCONT)
    back = b.wait_event(
        lambda e: e["event"] == "step" and e["replica"] != old_id, "a step as a new incarnation"
    )
    assert [e["replica_id"] for e in evicted] == [old_id], [
        (e["replica_id"], e.get("reason")) for e in evicted
    ]
    finals = [r.finish() for r in (a, b, c)]
    lines = check_run(job, [a, b, c], finals, reference["3"])
    stopped_at = max(e["step"] for e in b.steps() if e["replica"] == old_id)
    assert back["healed"] is True and back["participants"] == 3, back
    assert back["replica"].split(":")[0] == "b"
    for step in range(stopped_at + 1, back["step"]):
        assert {e["participants"] for e in lines[step].values()} == {2}, step
    for step in range(back["step"], STEPS + 1):
        assert {e["participants"] for e in lines[step].values()} == {3}, step
    assert "registering a new incarnation" in b.stderr_tail(1 << 20)
    print(
        f"hang: survivors stalled {gap(a, stopped_at + 1):.2f} s, "
        f"{gap(a, back['step']):.2f} s at the comeback (step {back['step']}); "
        f"evicted for: {evicted[0]['reason']}"
    )


# -- 4: min_replicas ----------------------------------------------------------------


def test_min_replicas_blocks_until_back(make_job: MakeJob, reference: dict[str, dict[str, Any]]):
    job = make_job(policy={"n_init_replicas": 2, "min_replicas": 2}, train={"step_delay_s": 0.02})
    job.start_controller()
    a, b = job.start_replica("a"), job.start_replica("b")
    b2 = job.start_replica("b", spare=True)  # its restart, warm: it saves a cold start
    b.wait_step(15)
    b.kill()
    killed_at = b.steps()[-1]["step"]
    time.sleep(2.0)
    # Alone, the survivor commits nothing.
    assert a.steps()[-1]["step"] == killed_at, a.steps()[-1]
    alone_until = time.monotonic()
    b2.release()
    resumed = a.wait_step(killed_at + 1)
    assert resumed["_at"] > alone_until
    finals = [r.finish() for r in (a, b2)]
    lines = check_run(job, [a, b, b2], finals, reference["3"])
    assert {e["participants"] for by_id in lines.values() for e in by_id.values()} == {2}
    assert first_step(b2)["healed"] is True
    assert_job_finished(job)
    print(f"min_replicas: survivor waited {gap(a, killed_at + 1):.2f} s for a second replica")


# -- 6: controller restart ------------------------------------------------------------


def test_controller_restart(make_job: MakeJob, reference: dict[str, dict[str, Any]]):
    # A replica whose quorum call straddles the restart enters its step's allreduce
    # late by the restart's time (a new interpreter and its imports: over 1 s on a
    # loaded machine), so its peer must wait longer than the 1 s default collective
    # timeout: else the two part ways at that step (seen in CI: one committed step
    # 16 alone, the other healed past it).
    job = make_job(
        policy={"n_init_replicas": 2},
        train={"step_delay_s": 0.01},
        timeouts={"collective_s": 5.0, "heartbeat_s": 10.0},
    )
    ctl = job.start_controller()
    url = (job.state_dir / "url").read_text()
    a, b = job.start_replica("a"), job.start_replica("b")
    a.wait_step(15)
    ctl.kill()
    killed_at = a.steps()[-1]["step"]
    job.start_controller()
    assert (job.state_dir / "url").read_text() == url  # same port: replicas re-attach
    finals = [r.finish() for r in (a, b)]
    lines = check_run(job, [a, b], finals, reference["3"])
    for r in (a, b):
        assert [e["step"] for e in r.steps()] == list(range(1, STEPS + 1)), r.label
    assert {e["participants"] for by_id in lines.values() for e in by_id.values()} == {2}
    assert job.status()["epoch"] == 2
    assert_job_finished(job)
    print(f"controller restart: replicas stalled {gap(a, killed_at + 1):.2f} s")

"""FT data parallel with ``train.exact_reduction``, end to end: a real controller, real
``phalanx replica`` processes of the built-in job in float32 (CPU, gloo), real
SIGKILL and SIGSTOP, a late joiner.

The claim under test (docs/architecture.md, "Bit-exact reduction"): whatever fails
and whoever joins, the final model and optimizer state are ``torch.equal`` to a
failure-free run's, and so is every committed step's loss; a calm run of 3
replicas and one of 1 replica end with the same bits. The FT invariants of
``test_ft_ddp.py`` hold as well (every step committed once and agreed on,
exactly-once data, every replica ending identical).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ftjob import (
    TRAIN,
    WAIT_S,
    FTJob,
    assert_identical,
    audit_job,
    cleanup_jobs,
    step_lines,
    write_job,
)

STEPS = 200
BATCH = TRAIN["global_batch_size"]
DATASET = TRAIN["dataset_size"]
SEED = 7  # ftjob.write_job's job.seed
EXACT = {"steps": STEPS, "dtype": "float32", "exact_reduction": True}
"""24 samples in 6 units of 4 (TRAIN's micro-batch): 2 per replica of 3, 3 per
replica of 2, 2-2-1-1 over 4, all 6 on one."""
PACE = {"step_delay_s": 0.03}
"""Per unit: a step lasts long enough for a kill to land inside it, and the steps
left after each fault take seconds however fast the machine is."""


def make(root: Path, name: str, made: list[FTJob], **kw: Any) -> FTJob:
    d = root / name
    d.mkdir()
    train = {**EXACT, **kw.pop("train", {})}
    job = FTJob(d, write_job(d / "job.toml", job_id=name, train=train, **kw))
    made.append(job)
    job.start_controller()
    return job


@pytest.fixture(scope="module")
def calm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Failure-free runs with 3 replicas and with 1, side by side: their final states
    (``"3"``, ``"1"``) and the loss of each of their steps (``"losses"``)."""
    root = tmp_path_factory.mktemp("calm")
    made: list[FTJob] = []
    try:
        runs = {}
        for n in (3, 1):
            job = make(root, f"calm{n}", made, policy={"n_init_replicas": n})
            runs[str(n)] = (job, [job.start_replica(f"r{i}") for i in range(n)])
        out: dict[str, Any] = {}
        for n, (job, replicas) in runs.items():
            finals = [r.finish() for r in replicas]
            assert_identical(finals)
            audit_job(job, STEPS)
            lines = step_lines(replicas)
            out[n] = finals[0]
            out[f"losses{n}"] = {s: next(iter(by.values()))["loss"] for s, by in lines.items()}
        yield out
    finally:
        cleanup_jobs(made, exit_grace_s=15.0)


def assert_equal_state(got: dict[str, Any], want: dict[str, Any]) -> None:
    assert_identical([want, got])


def test_a_calm_run_of_one_replica_ends_with_the_bits_of_three(calm: dict[str, Any]) -> None:
    assert_equal_state(calm["1"], calm["3"])
    assert calm["losses1"] == calm["losses3"]


def evicted(job: FTJob, rid: str) -> bool:
    return rid not in {m["replica_id"] for m in job.status()["roles"]["policy"]["replicas"]}


def wait_until(pred: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not pred():
        assert time.monotonic() < deadline, f"waited {WAIT_S} s for {what}"
        time.sleep(0.05)


def test_kills_a_hang_and_a_late_joiner_end_bit_identical_to_calm_runs(
    tmp_path: Path, calm: dict[str, Any]
) -> None:
    """3 replicas. c is SIGKILLed and restarted (it heals); b hangs (SIGSTOP) until
    evicted and comes back as a new incarnation (it heals); then d joins (it heals).
    Each phase waits for the previous one's event, never for a time."""
    made: list[FTJob] = []
    try:
        job = make(tmp_path, "chaos", made, policy={"n_init_replicas": 3}, train=PACE)
        a, b, c = (job.start_replica(n) for n in "abc")
        c2 = job.start_replica("c", spare=True)  # warm spares: a cold start is slow here
        d = job.start_replica("d", spare=True)
        # SIGKILL c mid-run; the survivors go on as 2; c comes back and heals.
        c.wait_step(10)
        c.kill()
        killed_at = c.steps()[-1]["step"]
        a.wait_event(
            lambda e: e["event"] == "step" and e["participants"] == 2, "a step of 2 survivors"
        )
        c2.release()
        back = c2.wait_step(1)
        assert back["healed"] is True, back
        # b hangs until the controller evicts it, then resumes as a new incarnation.
        old_b = b.wait_step(back["step"])["replica"]
        b.signal(signal.SIGSTOP)
        a.wait_event(
            lambda e: e["event"] == "step" and e["participants"] == 2 and e["step"] > back["step"],
            "a step without b",
        )
        wait_until(lambda: evicted(job, old_b), f"{old_b}'s eviction")
        b.signal(signal.SIGCONT)
        b_back = b.wait_event(
            lambda e: e["event"] == "step" and e["replica"] != old_b, "b as a new incarnation"
        )
        assert b_back["healed"] is True, b_back
        # d joins late: 4 replicas share the 6 units 2-2-1-1.
        d.release()
        joined = d.wait_step(1)
        assert joined["healed"] is True and joined["participants"] == 4, joined
        assert joined["step"] < STEPS, "the faults must land before the job's end: pace it more"
        replicas = [a, b, c, c2, d]
        finals = [r.finish() for r in (a, b, c2, d)]
        audit_job(job, STEPS)
        lines = step_lines(replicas)
        assert_identical(finals)
        seen = {e["participants"] for by in lines.values() for e in by.values()}
        assert seen >= {2, 3, 4}, seen
        # The claim: the bits of a calm run, of 3 replicas and of 1.
        assert_equal_state(finals[0], calm["3"])
        assert_equal_state(finals[0], calm["1"])
        losses = {s: next(iter(by.values()))["loss"] for s, by in lines.items()}
        assert losses == calm["losses3"]
        print(
            f"chaos: killed c at {killed_at}, b back at {b_back['step']}, d in at {joined['step']}"
        )
    finally:
        # No exit grace, as in test_ft_ddp's hang test: a replica that gave a patient
        # collective up holds that group for the patience after it (comm/torch_pg.py),
        # and one whose job ends meanwhile may abort in its teardown, after ``done``.
        cleanup_jobs(made)

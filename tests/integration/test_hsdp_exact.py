"""Replicas of several ranks (HSDP) with ``train.exact_reduction``, end to end: a real
controller, replicas of 2 ranks (FSDP2 over gloo inside each), float32, a real
SIGKILL of one rank (its replica fails whole, restarts and heals shard by shard)
and a SIGSTOP of a whole replica (evicted, it comes back as a new incarnation).

Each shard's cross-replica sum is exact, over units of one micro-batch per rank
(``phalanx.train.exact_grads``), so the final state and every step's loss are
``torch.equal`` to failure-free runs of the same layout: 2 replicas of 2 ranks,
and 1 replica of 2 ranks. (FSDP's reduce-scatter inside a replica is a float sum
over its ranks: runs of another number of ranks per replica differ in the last
bits, as they would without failures.)
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ftjob import (
    HELD_POLICY,
    HELD_TIMEOUTS,
    TRAIN,
    FTJob,
    Replica,
    assert_identical,
    audit_job,
    cleanup_jobs,
    held,
    kill_a_rank_and_heal,
    step_lines,
    wait_registered,
    write_job,
)

STEPS = 40
BATCH = TRAIN["global_batch_size"]
DATASET = TRAIN["dataset_size"]
SEED = 7
EXACT = {"steps": STEPS, "dtype": "float32", "exact_reduction": True, "step_delay_s": 0.05}
"""24 samples in 3 units of 8 (a micro-batch of 4 on each of 2 ranks): 2-1 over two
replicas, all 3 on one. The delay (per unit) lets a kill land inside a step."""


def make(root: Path, name: str, made: list[FTJob], **kw: Any) -> FTJob:
    d = root / name
    d.mkdir()
    job = FTJob(d, write_job(d / "job.toml", job_id=name, train=EXACT, ranks=2, **kw))
    made.append(job)
    job.start_controller()
    return job


@contextlib.contextmanager
def jobs_cleaned(exit_grace_s: float = 0.0) -> Iterator[list[FTJob]]:
    made: list[FTJob] = []
    try:
        yield made
    finally:
        cleanup_jobs(made, exit_grace_s)


def losses(replicas: list[Replica]) -> dict[int, float]:
    return {s: next(iter(by.values()))["loss"] for s, by in step_lines(replicas).items()}


@pytest.fixture(scope="module")
def calm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Failure-free runs of 2 replicas of 2 ranks and of 1 replica of 2 ranks, side by
    side: final states ``"2"``, ``"1"`` and step losses ``"losses2"``, ``"losses1"``."""
    root = tmp_path_factory.mktemp("calm")
    with jobs_cleaned(exit_grace_s=15.0) as made:
        runs = {}
        for n in (2, 1):
            job = make(root, f"calm{n}", made, policy={"n_init_replicas": n})
            runs[n] = (job, [job.start_replica(f"r{i}", ranks=2) for i in range(n)])
        out: dict[str, Any] = {}
        for n, (job, replicas) in runs.items():
            finals = [r.finish() for r in replicas]
            assert_identical(finals)
            audit_job(job, STEPS)
            out[str(n)], out[f"losses{n}"] = finals[0], losses(replicas)
        yield out


def test_a_calm_replica_of_two_ranks_alone_ends_with_the_bits_of_two(calm: dict[str, Any]):
    assert_identical([calm["2"], calm["1"]])
    assert calm["losses1"] == calm["losses2"]


def test_a_killed_rank_and_a_stopped_replica_end_bit_identical_to_calm_runs(
    tmp_path: Path, calm: dict[str, Any]
) -> None:
    with jobs_cleaned() as made:
        job = make(tmp_path, "chaos", made, policy=HELD_POLICY, timeouts=HELD_TIMEOUTS)
        a, b = job.start_replica("a", ranks=2), job.start_replica("b", ranks=2)
        b2 = job.start_replica("b", ranks=2, spare=True)  # (ftjob.GATED_SPARE)
        # One rank of b is SIGKILLed: b fails whole; a trains alone; b restarts and heals.
        gone, healed = kill_a_rank_and_heal(job, a, b, b2, at=5)
        assert healed["participants"] == 2, healed
        # a is stopped whole until b2 trains without it; then it comes back and heals
        # (b2 held until a has registered again, so that the job cannot end first).
        old_a = a.steps()[-1]["replica"]
        with held(a):
            alone = b2.wait_event(
                lambda e: e["event"] == "step" and e["participants"] == 1, "b alone"
            )
            b2.signal(signal.SIGSTOP)
        try:
            wait_registered(job, "a", other_than=old_a)
        finally:
            b2.signal(signal.SIGCONT)
        back = a.wait_event(
            lambda e: e["event"] == "step" and e["replica"] != old_a, "a as a new incarnation"
        )
        assert back["healed"] is True and back["step"] > alone["step"], back
        finals = [a.finish(), b2.finish()]
        replicas = [a, b, b2]
        audit_job(job, STEPS)
        lines = step_lines(replicas)
        assert_identical(finals)
        assert {e["participants"] for by in lines.values() for e in by.values()} == {1, 2}
        assert_identical([calm["2"], finals[0]])
        assert_identical([calm["1"], finals[0]])
        assert losses(replicas) == calm["losses2"]
        print(
            f"hsdp chaos: b's rank killed after {gone['step'] - 1}, b back at "
            f"{healed['step']}, a back at {back['step']}"
        )

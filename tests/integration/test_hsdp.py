"""Replicas of several ranks (HSDP) end to end: a real controller, replicas of 2
ranks each started by ``phalanx.launch.ranks``, FSDP2 over gloo inside each
replica, real SIGKILL of one rank and SIGSTOP of a whole replica, and a change
of layout (2 ranks per replica to 3) through a checkpoint.

Each scenario keeps the FT invariants of ``test_ft_ddp.py`` (every step
committed once, agreed on, exactly-once data over the replicas' shares) and
ends with every replica's gathered state equal to a failure-free run's to
1e-9 (float64): the reference is one unsharded replica, so the sharding and
the split over ranks do not change the numbers either.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ftjob import (
    HELD_POLICY,
    HELD_TIMEOUTS,
    TRAIN,
    WAIT_S,
    FTJob,
    Replica,
    assert_close,
    assert_identical,
    assert_same_files,
    audit_job,
    held,
    kill_a_rank_and_heal,
    write_job,
)

from phalanx.checkpoint import CheckpointStore

STEPS = 30
LONG = 60
BATCH = TRAIN["global_batch_size"]
DATASET = TRAIN["dataset_size"]
SEED = 7
ATOL = 1e-9
PACE = {"step_delay_s": 0.05}
"""Per micro-batch: 3 micro-batches per rank and step, so a step lasts long
enough for a kill to land inside it, and the steps left after it take seconds."""


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[list[FTJob]]:
    made: list[FTJob] = []
    try:
        yield made
    finally:
        for j in made:
            j.cleanup()


def make(root: Path, name: str, made: list[FTJob], ranks: int, **kw: Any) -> FTJob:
    d = root / name
    d.mkdir()
    train = {"steps": STEPS, **kw.pop("train", {})}
    job = FTJob(d, write_job(d / "job.toml", job_id=name, train=train, ranks=ranks, **kw))
    made.append(job)
    job.start_controller()
    return job


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Any]]:
    """Final states of failure-free runs of one unsharded replica, by step count
    (``STEPS`` and ``LONG``), run side by side."""
    made: list[FTJob] = []
    root = tmp_path_factory.mktemp("ref")
    try:
        runs = {
            n: make(root, f"ref{n}", made, ranks=1, train={"steps": n}).start_replica("r0")
            for n in (STEPS, LONG)
        }
        yield {n: r.finish() for n, r in runs.items()}
    finally:
        for j in made:
            j.cleanup(exit_grace_s=15.0)


def check(
    job: FTJob,
    replicas: list[Replica],
    finals: list[dict[str, Any]],
    reference: dict[int, Any],
    steps: int = STEPS,
) -> None:
    audit_job(job, steps)
    assert_identical(finals)
    assert_same_files(replicas, steps)
    worst = assert_close(finals[0], reference[steps], ATOL)
    print(f"largest difference from the failure-free run: {worst:.3g}")


def test_two_replicas_of_two_ranks_match_one_unsharded_replica(
    tmp_path: Path, jobs: list[FTJob], reference: dict[int, Any]
) -> None:
    job = make(tmp_path, "calm", jobs, ranks=2, policy={"n_init_replicas": 2})
    a, b = job.start_replica("a", ranks=2), job.start_replica("b", ranks=2)
    a.wait_step(1)
    members = job.status()["roles"]["policy"]["replicas"]
    assert len(members) == 2 and all(m["ranks"] == 2 for m in members), members
    finals = [a.finish(), b.finish()]
    check(job, [a, b], finals, reference)
    steps = a.steps()
    assert {e["participants"] for e in steps} == {2} and {e["ranks"] for e in steps} == {2}


def test_a_rank_killed_mid_step_fails_its_replica_which_comes_back_and_heals(
    tmp_path: Path, jobs: list[FTJob], reference: dict[int, Any]
) -> None:
    job = make(
        tmp_path, "kill", jobs, ranks=2, train=PACE, policy=HELD_POLICY, timeouts=HELD_TIMEOUTS
    )
    a, b = job.start_replica("a", ranks=2), job.start_replica("b", ranks=2)
    b2 = job.start_replica("b", ranks=2, spare=True)  # (ftjob.GATED_SPARE)
    # The survivor commits without b, and b, restarted whole, heals shard by shard
    # and trains beside it.
    gone, healed = kill_a_rank_and_heal(job, a, b, b2, at=8)
    assert healed["participants"] == 2 and healed["step"] > gone["step"]
    finals = [a.finish(), b2.finish()]
    check(job, [a, b, b2], finals, reference)
    err = b.err_path.read_text(errors="replace")
    assert "stopping the replica's other ranks" in err or "the replica stops" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_a_replica_stopped_whole_is_left_behind_and_rejoins(
    tmp_path: Path, jobs: list[FTJob], reference: dict[int, Any]
) -> None:
    # The default test timeouts (ftjob.TIMEOUTS): the stopped replica is evicted
    # within the heartbeat timeout, the survivor goes on after its collective
    # timeout. LONG steps at >= 0.3 s leave the survivor busy for long after b is
    # let go: b (warm) needs about a second to register again and heal.
    job = make(
        tmp_path,
        "stop",
        jobs,
        ranks=2,
        train={**PACE, "steps": LONG},
        policy={"n_init_replicas": 2},
    )
    a, b = job.start_replica("a", ranks=2), job.start_replica("b", ranks=2)
    b.wait_step(5)
    with held(b):  # the launcher and both ranks: one process group
        alone = a.wait_event(
            lambda e: e["event"] == "step" and e["participants"] == 1, "a step without b"
        )
    back = b.wait_event(
        lambda e: e["event"] == "step" and e["healed"] and e["step"] > alone["step"],
        "b to heal and rejoin",
    )
    assert back["participants"] == 2
    finals = [a.finish(), b.finish()]
    check(job, [a, b], finals, reference, steps=LONG)


def post(job: FTJob, path: str, body: dict[str, Any]) -> dict[str, Any]:
    url = (job.state_dir / "url").read_text().strip()
    token = (job.state_dir / "token").read_text().strip()
    r = httpx.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    return dict(r.json())


# Slow (110 s here): the default run keeps a layout change through a resharded
# checkpoint under phalanx run (test_checkpoint_resume), the HF model's 3x2 -> 2x1
# (test_hf_jobs) and the controller's refusal of another layout while one lives
# (test_state).
@pytest.mark.slow
def test_a_new_layout_takes_over_through_the_checkpoint_resharded(
    tmp_path: Path, jobs: list[FTJob], reference: dict[int, Any]
) -> None:
    """Replicas of 2 ranks save checkpoints. A replica of 1 rank is refused while
    they live (one line, exit 78; they go on). The operator drains them: the last to
    leave saves its step. A replica of 3 ranks then loads that checkpoint, resharded
    (DCP), and finishes the job: one lineage, exactly-once data, and the final state
    of a failure-free unsharded run."""
    root = tmp_path / "ckpt"
    opts = ("--checkpoint.url", f"file://{root}", "--checkpoint.every_steps", "5")
    job = make(
        tmp_path,
        "resize",
        jobs,
        ranks=2,
        train=PACE,
        timeouts=HELD_TIMEOUTS,
        policy=HELD_POLICY,
    )
    a, b = job.start_replica("a", *opts, ranks=2), job.start_replica("b", *opts, ranks=2)
    c = job.start_replica("c", *opts, "--replica.ranks", "1", spare=True)  # (warm)
    ids = [a.wait_step(3)["replica"], b.wait_step(3)["replica"]]

    with held(a), held(b):  # still members, but the steps wait for the refusal
        c.release()
        assert c.popen.wait(WAIT_S) == 78
    said = [x for x in c.stderr_tail().splitlines() if "refused" in x]
    assert len(said) == 1 and "spans 1 ranks but role 'policy''s live replicas span 2" in said[0]
    assert "Traceback" not in c.stderr_tail()

    for rid in ids:
        post(job, "/v1/replicas/drain", {"replica_id": rid})
    left = [r.wait_event(lambda e: e["event"] == "done", "drained") for r in (a, b)]
    assert all(d.get("drained") for d in left), left
    assert a.popen.wait(WAIT_S) == 0 and b.popen.wait(WAIT_S) == 0
    last = max(d["step"] for d in left)
    assert last < STEPS, "drained too late for the new layout to train any step"
    store = CheckpointStore(f"file://{root}")
    assert store.latest() == last
    assert store.manifest(last).layout["ranks"] == 2

    d = job.start_replica("d", *opts, "--replica.ranks", "3", ranks=3)
    final = d.finish(timeout=3 * WAIT_S)  # a cold start of 3 ranks, then the job's rest
    start = d.wait_event(lambda e: e["event"] == "start", "start")
    assert start["resumed_from"] == last and start["ranks"] == 3
    # (a step of the new layout at or below the checkpoint: steps.once fails)
    audit_job(job, STEPS)
    worst = assert_close(final, reference[STEPS], ATOL)
    print(f"largest difference from the failure-free run: {worst:.3g}")
    assert store.latest() == STEPS and store.manifest(STEPS).layout["ranks"] == 3

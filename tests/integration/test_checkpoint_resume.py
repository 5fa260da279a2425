"""The FT data-parallel job resumes from a universal checkpoint with another
number of replicas, after every replica and the controller were SIGKILLed.

The lineage that survives is: the killed job's steps up to its latest
committed checkpoint C, then the new job's steps C+1..N. Along it:

- every step committed once, the data consumed exactly once (the shares of a
  step concatenate to its global batch; the steps to the sampler's stream);
- the new replicas end bit-identical, and within 1e-9 (float64) of a
  failure-free single-replica run: the checkpoint carried model, optimizer,
  step, data cursor and RNG.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from ftjob import (
    TRAIN,
    FTJob,
    Replica,
    assert_close,
    assert_identical,
    audit_job,
    write_job,
)
from procs import run_to_end

from phalanx.checkpoint import Checkpointer, CheckpointStore
from phalanx.checkpoint.base import step_dir

STEPS = 30
BATCH = TRAIN["global_batch_size"]
SEED = 7
EVERY = 5


def _job(root: Path, name: str, jobs: list[FTJob], n: int, **train: Any) -> FTJob:
    d = root / name
    d.mkdir()
    cfg = write_job(
        d / "job.toml", job_id=name, train={"steps": STEPS, **train}, policy={"n_init_replicas": n}
    )
    job = FTJob(d, cfg)
    jobs.append(job)
    job.start_controller()
    return job


def check_killed_job(job: FTJob, upto: int) -> None:
    """The product audit of a job killed whole (its controller with its replicas): each
    step printed was committed once, never backwards, on the sampler's batches, and
    steps 1..``upto`` (the checkpoint the next job resumes from) are all there. Its
    completeness against the journal is not asked: the controller, killed with the
    replicas, may not have journaled the step they printed last."""
    from phalanx.audit import audit_checks, load_job

    logs = [p.out_path for p in job.procs if isinstance(p, Replica) and p.events]
    run = load_job(job.state_dir, logs)
    verdicts = {c.name: (c.verdict, c.detail) for c in audit_checks(run)}
    for name in ("steps.once", "steps.order", "data.samples"):
        assert verdicts[name][0] == "pass", (name, verdicts[name])
    assert set(range(1, upto + 1)) <= {e["step"] for e in run.steps()}


@pytest.mark.parametrize(
    ("old", "new"), [(2, 3), pytest.param(8, 6, marks=pytest.mark.slow)], ids=["2to3", "8to6"]
)
def test_resume_with_another_replica_count_after_everything_was_killed(
    tmp_path: Path, old: int, new: int
):
    ckpt = f"file://{tmp_path / 'ckpt'}"
    opts = ("--checkpoint.url", ckpt, "--checkpoint.every_steps", str(EVERY))
    jobs: list[FTJob] = []
    try:
        ref = _job(tmp_path, "ref", jobs, 1)
        ref_replica = ref.start_replica("r0")

        first = _job(tmp_path, "first", jobs, old, step_delay_s=0.03)
        killed = [first.start_replica(f"a{i}", *opts) for i in range(old)]
        # Wait for a committed checkpoint and a few steps past it, then kill everything.
        ck = killed[0].wait_event(
            lambda e: e["event"] == "checkpoint" and e["step"] >= 2 * EVERY, "a checkpoint"
        )
        killed[0].wait_step(ck["step"] + 2)
        for p in [*killed, first.controller]:
            assert p is not None
            p.signal(signal.SIGKILL)
        for p in killed:
            p.popen.wait(10)
        store = CheckpointStore(ckpt)
        latest = store.latest()
        assert latest is not None and latest >= ck["step"] and latest % EVERY == 0
        assert store.manifest(latest).extra["config"]["train"]["steps"] == STEPS

        second = _job(tmp_path, "second", jobs, new)
        resumed = [second.start_replica(f"b{i}", *opts) for i in range(new)]
        finals = [r.finish() for r in resumed]
        starts = [r.wait_event(lambda e: e["event"] == "start", "start") for r in resumed]
        assert {s["resumed_from"] for s in starts} == {latest}

        # The lineage: the first job's steps to the checkpoint, then the second's from
        # it (the audit of a job resumed whole starts after the checkpoint it resumed).
        check_killed_job(first, latest)
        run = audit_job(second, STEPS)
        assert {e["participants"] for e in run.steps()} == {new}
        assert min(e["step"] for e in run.steps()) == latest + 1
        assert_identical(finals)
        assert_close(finals[0], ref_replica.finish(), 1e-9)
        # The new job's controller knows its checkpoints; the last one is the final step.
        assert second.status()["checkpoints"]["latest"]["step"] == STEPS
        assert store.latest() == STEPS
        assert len(store.steps()) <= 3  # keep_last
    finally:
        errors = []
        for j in jobs:
            try:
                j.cleanup(exit_grace_s=10.0)
            except AssertionError as e:
                errors.append(e)
        if errors:
            raise errors[0]


def test_no_usable_checkpoint_stops_the_job_in_one_line(tmp_path: Path):
    """Every replica raised an uncaught CheckpointError (a traceback each) and the
    launcher restarted them into "exited 3 times in a row without progress" (issue
    20). Now the first replica to find no usable checkpoint says so in one line, with
    the URL, and the job stops at once."""
    root = tmp_path / "ckpt"
    Checkpointer(f"file://{root}").save(3, {"model": {"w": torch.ones(2)}})
    (root / step_dir(3) / "phalanx.json").write_text("not a manifest")
    example = Path(__file__).parents[2] / "examples" / "ft_mlp.toml"
    args = [sys.executable, "-m", "phalanx.cli", "run", str(example), "--plain", "--json"]
    args += ["--run-dir", str(tmp_path / "run"), "--checkpoint.url", f"file://{root}"]
    args += ["--train.steps", "20", "--roles.policy.n_init_replicas", "2"]
    p = run_to_end(args, 240)
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]
    s = json.loads(p.stdout.strip().splitlines()[-1])
    assert s["error"].startswith("policy-"), s
    assert "cannot run: phalanx replica policy-" in s["error"]
    assert f"no usable checkpoint under file://{root}: step 3: " in s["error"]
    assert "restarting" not in p.stdout and "without progress" not in p.stdout
    # Said once as it happened (then in the summary): not once per replica or restart.
    notes = [x for x in p.stdout.splitlines() if "s  policy-" in x and "cannot run:" in x]
    assert len(notes) == 1, p.stdout


def _run(tmp_path: Path, name: str, *args: str) -> tuple[dict[str, Any], Path]:
    """``phalanx run examples/ft_hsdp.toml`` with 2 replicas and ``args``: its summary
    and run dir."""
    example = Path(__file__).parents[2] / "examples" / "ft_hsdp.toml"
    run_dir = tmp_path / name
    cmd = [sys.executable, "-m", "phalanx.cli", "run", str(example), "--plain", "--json"]
    cmd += ["--run-dir", str(run_dir), "--roles.policy.n_init_replicas", "2", *args]
    p = run_to_end(cmd, 600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1]), run_dir


def test_phalanx_run_saves_the_last_step_of_sharded_replicas_and_another_layout_resumes(
    tmp_path: Path,
) -> None:
    """Replicas of 2 ranks end the job with its last step durable (the launcher lets
    the quorum's first replica finish its save), and unsharded replicas resume from
    that checkpoint to the numbers of an uninterrupted unsharded run."""
    from safetensors.torch import load_file

    ckpt = f"file://{tmp_path / 'ckpt'}"
    first, _ = _run(tmp_path, "sharded", "--checkpoint.url", ckpt, "--train.steps", "12")
    assert first["steps"] == 12
    store = CheckpointStore(ckpt)
    assert store.latest() == 12 and store.manifest(12).layout["ranks"] == 2
    args = ("--replica.ranks", "1", "--train.steps", "16")
    resumed, rdir = _run(tmp_path, "resumed", "--checkpoint.url", ckpt, *args)
    reference, ref_dir = _run(tmp_path, "reference", *args)
    lines = (rdir / "policy-0.log").read_text().splitlines()
    starts = [json.loads(x) for x in lines if x.startswith('{"event": "start"')]
    assert starts and starts[-1]["resumed_from"] == 12, lines[-20:]
    # float32: the sharded steps summed in another order than the unsharded ones.
    assert resumed["loss"] == pytest.approx(reference["loss"], rel=1e-4)
    got = load_file(rdir / "final" / "policy-0.safetensors")
    ref = load_file(ref_dir / "final" / "policy-0.safetensors")
    assert [k for k in ref if k.startswith("model.")]
    for k in ref:
        if k.startswith("model."):
            torch.testing.assert_close(got[k], ref[k], rtol=1e-4, atol=1e-5)

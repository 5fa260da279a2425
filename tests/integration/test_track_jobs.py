"""Experiment tracking of training jobs under ``phalanx run`` (issue 41): an FT
job and a sync DiLoCo job of two replicas, and a decoupled DiLoCo job of two
slots, each write
TensorBoard event files, and an MLflow file store where ``mlflow-skinny`` is
installed, in their run directory, with one value per committed step (every
replica prints each step: the launcher logs it once), under ``train/<field>``
for each numeric field of the step lines, and the ``job/heals`` and
``job/kills`` counters. The agent's and Ray's tracking are tested beside
theirs (test_agent.py, test_ray_launch.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from procs import PROGRESS_S, run_to_end

from phalanx.testing.track import mlflow_metrics, tensorboard_scalars

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
HAVE_MLFLOW = importlib.util.find_spec("mlflow") is not None


def run(example: str, run_dir: Path, *args: str) -> None:
    cmd = [sys.executable, "-m", "phalanx.cli", "run", str(EXAMPLES / example), "--plain"]
    cmd += ["--run-dir", str(run_dir), *args]
    if HAVE_MLFLOW:
        cmd += ["--track.mlflow", "true"]
    p = run_to_end(cmd, PROGRESS_S)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]


def check(run_dir: Path, experiment: str, steps: int, fields: set[str], absent: set[str]) -> None:
    """One value per step 1..steps for every metric; ``fields`` among them."""
    stores = {"tb": tensorboard_scalars(run_dir / "tb")}
    if HAVE_MLFLOW:
        stores["mlflow"] = mlflow_metrics(run_dir / "mlruns", experiment)
    for where, got in stores.items():
        names = set(got)
        assert fields <= names and not names & absent, (where, sorted(names))
        for name, values in got.items():
            assert [s for s, _ in values] == list(range(1, steps + 1)), (where, name, values)
        assert {v for _, v in got["job/kills"]} == {0.0}, where


def test_an_ft_job_logs_each_committed_step_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["--replicas", "2", "--roles.policy.n_init_replicas", "2", "--train.steps", "6"]
    run("ft_mlp.toml", run_dir, *args, "--train.step_delay_s", "0")
    fields = {"train/loss", "train/participants", "job/heals", "job/kills"}
    check(run_dir, "ft-mlp", 6, fields, {"train/cursor", "train/quorum_id", "train/t"})
    assert {v for _, v in tensorboard_scalars(run_dir / "tb")["train/participants"]} == {2.0}


def test_a_sync_diloco_job_logs_each_outer_round_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["--replicas", "2", "--roles.policy.n_init_replicas", "2", "--train.steps", "20"]
    run("diloco_sync.toml", run_dir, *args, "--diloco.sync_every", "10", "--train.step_delay_s=0")
    fields = {"train/loss", "train/participants", "train/bytes_sent", "job/heals", "job/kills"}
    check(run_dir, "diloco-sync", 2, fields, {"train/inner_step", "train/cursor"})


def test_a_decoupled_diloco_job_logs_each_round_once(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["--replicas", "2", "--diloco.min_replicas", "2", "--diloco.url", str(tmp_path / "st")]
    args += ["--train.steps", "30", "--diloco.sync_every", "10"]
    run("diloco_objectstore.toml", run_dir, *args)
    fields = {"train/loss", "train/bytes_sent", "train/round_s", "job/heals", "job/kills"}
    absent = {"train/round", "train/inner_step", "train/data_step", "train/included"}
    check(run_dir, "diloco-objectstore", 3, fields, absent)

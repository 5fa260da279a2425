"""Experiment tracking: batch records as flat metrics, TensorBoard event files read back,
an offline wandb run, a failing tracker dropped without stopping the others."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest

from phalanx.config.rl import TrackSection
from phalanx.protocol.status import BatchRecord
from phalanx.track.base import Tracker, Trackers, batch_metrics
from phalanx.track.trackers import trackers


def _record(batch: int, **metrics: float) -> BatchRecord:
    return BatchRecord.model_validate(
        {
            "batch": batch,
            "step": batch + 1,
            "reward": 0.25 * batch,
            "exact_match": 0.5,
            "reward_avg": 0.1,
            "exact_match_avg": 0.4,
            "staleness": 1,
            "at": 100.0 + batch,
            "tokens_per_s": 321.5,
            **({"metrics": metrics} if metrics else {}),
        }
    )


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_a_batch_record_flattens_to_grouped_scalars():
    m = batch_metrics(
        _record(2, tokens=40, entropy=1.25, mfu=0.31, train_tokens_per_s=900.0),
        {"stale": 3, "reward_error": 1},
    )
    assert m == {
        "rl/reward": 0.5,
        "rl/exact_match": 0.5,
        "rl/reward_avg": 0.1,
        "rl/exact_match_avg": 0.4,
        "rl/staleness": 1.0,
        "rl/policy_step": 3.0,
        "rl/tokens": 40.0,
        "perf/tokens_per_s": 321.5,
        "perf/train_tokens_per_s": 900.0,
        "perf/mfu": 0.31,
        "policy/entropy": 1.25,
        "discarded/stale": 3.0,
        "discarded/reward_error": 1.0,
    }


def test_tensorboard_event_files_read_back(tmp_path: Path):
    t = trackers(TrackSection(), tmp_path, "run", {})
    for b in range(3):
        t.log(b, batch_metrics(_record(b, entropy=1.0 + b)), wall=1000.0 + b)
    t.log(1, {"rl/reward": 99.0})  # already logged: ignored
    t.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert [e.wall_time for e in acc.Scalars("rl/reward")] == [1000.0, 1001.0, 1002.0]
    got = _scalars(tmp_path / "tb")
    assert got["rl/reward"] == [(0, 0.0), (1, 0.25), (2, 0.5)]
    assert got["policy/entropy"] == [(0, 1.0), (1, 2.0), (2, 3.0)]
    assert got["perf/tokens_per_s"][-1] == (2, 321.5)


def test_wandb_writes_an_offline_run_under_the_run_dir(tmp_path: Path, monkeypatch):
    pytest.importorskip("wandb")  # a dev install has it: the `track` extra
    monkeypatch.setenv("WANDB_SILENT", "true")
    t = trackers(
        TrackSection(tensorboard=False, wandb=True, wandb_project="p"),
        tmp_path,
        "math-run",
        {"rl": {"grpo": {"lr": 1e-5}}},
    )
    for b in range(2):
        t.log(b, batch_metrics(_record(b, entropy=0.5)))
    t.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    data = runs[0].read_bytes()
    for key in (b"rl/reward", b"policy/entropy", b"perf/tokens_per_s", b"math-run"):
        assert key in data


def test_wandb_not_installed_is_one_line(tmp_path: Path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_wandb(name: str, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(ValueError, match=r"needs the wandb package.*phalanx\[track\]"):
        trackers(TrackSection(tensorboard=False, wandb=True), tmp_path, "r", {})


class _Broken(Tracker):
    def log(self, step: int, metrics: Mapping[str, float], wall: float | None = None) -> None:
        raise OSError("disk full")

    def close(self) -> None:
        raise AssertionError("a dropped tracker is not closed")


def test_a_tracker_that_fails_is_dropped_and_the_others_go_on(tmp_path: Path):
    from phalanx.track.tensorboard import TensorBoardTracker

    tb = TensorBoardTracker(tmp_path)
    t = Trackers([_Broken(), tb])
    t.log(0, {"rl/reward": 1.0})
    t.log(1, {"rl/reward": 2.0})
    assert t.trackers == [tb]
    t.close()
    assert _scalars(tmp_path)["rl/reward"] == [(0, 1.0), (1, 2.0)]

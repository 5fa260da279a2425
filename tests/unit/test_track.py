"""Experiment tracking: batch records and step lines as flat metrics, each step
logged once, TensorBoard event files and an MLflow file store read back, an
offline wandb run, a failing tracker dropped without stopping the others, and
the one ``[track]`` section of every job kind."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import pytest

from phalanx.config.rl import TrackSection
from phalanx.protocol.status import BatchRecord
from phalanx.testing.track import mlflow_metrics, tensorboard_scalars
from phalanx.track.base import Tracker, Trackers, batch_metrics
from phalanx.track.job import JobTracking, step_metrics
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


_scalars = tensorboard_scalars


def test_a_batch_record_flattens_to_grouped_scalars():
    m = batch_metrics(
        _record(2, tokens=40, entropy=1.25, mfu=0.31, train_tokens_per_s=900.0, idle=0.4),
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
        "perf/idle": 0.4,
        "discarded/stale": 3.0,
        "discarded/reward_error": 1.0,
    }


def test_off_policy_metrics_are_tracked():
    rec = _record(
        2, ess=0.5, mismatch_kl=0.01, is_clip_frac=0.25, staleness_tokens={"0": 7, "3": 2}
    )
    m = batch_metrics(rec)
    assert {k: v for k, v in m.items() if k.startswith(("offpolicy/", "staleness_"))} == {
        "offpolicy/ess": 0.5,
        "offpolicy/mismatch_kl": 0.01,
        "offpolicy/is_clip_frac": 0.25,
        "staleness_tokens/0": 7.0,
        "staleness_tokens/3": 2.0,
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


# -- every job kind: step lines, MLflow, the [track] section ---------------------


def _line(step: int, replica: str, **extra) -> dict:
    return {
        "event": "step",
        "replica": replica,
        "step": step,
        "loss": 1.0 / step,
        "participants": 2,
        "quorum_id": 3,
        "healed": False,
        "cursor": step * 24,
        "samples": [1, 2],
        "t": 1000.0 + step,
        **extra,
    }


def test_a_step_line_logs_every_numeric_field_but_the_bookkeeping():
    got = step_metrics(_line(4, "a:1", tokens_per_s=812.5, mfu=0.25, val_loss=0.5, ranks=2))
    assert got == {
        "train/loss": 0.25,
        "train/participants": 2.0,
        "train/tokens_per_s": 812.5,
        "train/mfu": 0.25,
        "train/val_loss": 0.5,
    }
    round_line = {"event": "round", "round": 3, "inner_step": 60, "loss": 0.5, "included": True}
    assert step_metrics(round_line) == {"train/loss": 0.5}


def test_each_step_is_logged_once_whichever_replicas_print_it(tmp_path: Path):
    t = JobTracking(trackers(TrackSection(), tmp_path, "run", {}))
    t.line(_line(1, "a:1"))
    t.line(_line(1, "b:1"))  # the same step from the other participant
    t.line({"event": "retry", "step": 2})
    t.killed()
    t.line(_line(2, "b:1"))
    t.line(_line(3, "a:2", healed=True))  # a's restart healed from b
    t.line(_line(3, "b:1"))
    t.line(_line(2, "a:2"))  # late: step 2 is logged already
    t.line(_line(4, "a:2", healed=True))  # the same heal, printed again: counted once
    t.close()
    got = _scalars(tmp_path / "tb")
    assert got["train/loss"] == [(1, 1.0), (2, 0.5), (3, pytest.approx(1 / 3)), (4, 0.25)]
    assert got["job/kills"] == [(1, 0.0), (2, 1.0), (3, 1.0), (4, 1.0)]
    assert got["job/heals"] == [(1, 0.0), (2, 0.0), (3, 1.0), (4, 2.0)]
    assert "train/cursor" not in got and "train/t" not in got


def test_an_rl_job_logs_its_ledger_not_step_lines(tmp_path: Path):
    t = JobTracking(trackers(TrackSection(), tmp_path, "run", {}), rl=True)
    t.line(_line(1, "policy-0:1"))
    t.close()
    assert _scalars(tmp_path / "tb") == {}


def test_mlflow_writes_a_file_store_under_the_run_dir(tmp_path: Path, monkeypatch):
    pytest.importorskip("mlflow")  # the `track` extra's mlflow-skinny
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    t = JobTracking(
        trackers(
            TrackSection(tensorboard=False, mlflow=True), tmp_path, "ft-run", {"a": 1}, "ft-job"
        )
    )
    for step in (1, 2, 2, 3):
        t.line(_line(step, "a:1"))
    t.close()
    assert (tmp_path / "mlruns").is_dir()
    assert mlflow_metrics(tmp_path / "mlruns", "ft-job") == {
        "train/loss": [(1, 1.0), (2, 0.5), (3, 1 / 3)],
        "train/participants": [(1, 2.0), (2, 2.0), (3, 2.0)],
        "job/heals": [(1, 0.0), (2, 0.0), (3, 0.0)],
        "job/kills": [(1, 0.0), (2, 0.0), (3, 0.0)],
    }


def test_mlflow_not_installed_is_one_line(tmp_path: Path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_mlflow(name: str, *args, **kwargs):
        if name.startswith("mlflow"):
            raise ImportError("No module named 'mlflow'")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_mlflow)
    with pytest.raises(ValueError, match=r"needs the mlflow-skinny package.*phalanx\[track\]"):
        trackers(TrackSection(mlflow=True), tmp_path, "r", {})


def test_track_is_one_section_for_every_job_kind_and_rl_track_still_reads(tmp_path: Path):
    from phalanx.config import ConfigError, load_config

    ft = tmp_path / "ft.toml"
    ft.write_text("[track]\nmlflow = true\nmlflow_experiment = 'e'\n")
    assert load_config(ft).track.mlflow
    assert load_config(ft, ["--track.wandb", "true"]).track.wandb
    rl = tmp_path / "rl.toml"
    rl.write_text(
        "[roles.policy]\n[roles.rollout]\n[rl.model]\nhidden_size = 32\n"
        "[rl.track]\nwandb = true\npeak_tflops = 5.0\n"
    )
    cfg = load_config(rl, ["--track.tensorboard", "false"])
    assert cfg.track == cfg.rl.track  # one section, read from both places
    assert (cfg.track.wandb, cfg.track.peak_tflops, cfg.track.tensorboard) == (True, 5.0, False)
    with pytest.raises(ConfigError) as e:
        load_config(rl, ["--track.wandb", "false"])
    assert "(top level): track.wandb must be given once: got False in [track]" in str(e.value)


def test_the_tracking_agent_reads_whole_lines_of_every_generation(tmp_path: Path):
    import json

    from phalanx.launch.agent.track import AgentTrack

    job = tmp_path / "job.toml"
    job.write_text("[job]\nid = 'j'\n")
    with pytest.raises(ValueError, match="give it to an agent that runs a replica"):
        AgentTrack(str(job), tmp_path, None, workers=False)
    run = tmp_path / "agent"
    t = AgentTrack(str(job), run, None)
    (run / "gen0").mkdir(parents=True)
    out0 = run / "gen0" / "rank0.out"
    text = "".join(json.dumps(_line(s, "a:1")) + "\n" for s in (1, 2))
    out0.write_text("not json\n" + text + json.dumps(_line(3, "a:1"))[:20])  # 3: half written
    t.poll(0, force=True)
    t.killed()
    (run / "gen1").mkdir()
    (run / "gen1" / "rank0.out").write_text(json.dumps(_line(4, "a:2", healed=True)) + "\n")
    t.close(1)  # gen0's unfinished line never ends: gen1's lines are read after it
    got = tensorboard_scalars(run / "tb")
    assert got["train/loss"] == [(1, 1.0), (2, 0.5), (4, 0.25)]
    assert got["job/kills"][-1] == (4, 1.0) and got["job/heals"][-1] == (4, 1.0)

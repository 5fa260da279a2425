"""The pure parts of bench/rl_async.py (bench/rl_async_arms.py): the arms' overrides,
log lines to an arm's figures, the ratios against the sync arm and TRL, and the
reward gap at the sync arm's sample count. No job runs here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from phalanx.config import ConfigError, JobConfig, load_config

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("rl_async_arms", ROOT / "bench" / "rl_async_arms.py")
assert _spec is not None and _spec.loader is not None
ra = importlib.util.module_from_spec(_spec)
sys.modules["rl_async_arms"] = ra  # dataclasses resolve the module's annotations through it
_spec.loader.exec_module(ra)


def step(batch: int, reward: float, t: float, **extra: float) -> dict:
    return {"event": "step", "batch": batch, "reward": reward, "t": t, **extra}


def test_arms_set_staleness_ahead_and_correction():
    by = {a.name: dict(a.overrides) for a in ra.arms("tis_token", inner_epochs=2)}
    assert list(by) == [
        "sync",
        "async2",
        "async2_tis_token",
        "async4",
        "async4_tis_token",
        "replay",
        "waiting",
    ]
    assert {by[n]["rl.engine.chunk"] for n in by} == {"2"}
    assert by["waiting"]["rl.engine.inflight_updates"] == "false"
    assert by["waiting"]["rl.grpo.correction"] == "tis_token"
    assert "rl.engine.inflight_updates" not in by["async2_tis_token"]
    assert by["sync"]["rl.loop.max_staleness"] == "0" and by["sync"]["rl.loop.sync_every"] == "1"
    # 2 versions per batch: staleness 2 is one batch behind, 4 two.
    assert [by[n]["rl.loop.max_ahead"] for n in ("sync", "async2", "async4")] == ["1", "1", "2"]
    assert by["async4_tis_token"]["rl.grpo.correction"] == "tis_token"
    assert by["replay"]["rl.loop.replay_ratio"] == "0.25"
    assert by["replay"]["rl.transport.replay"] == "memory"
    assert by["replay"]["rl.loop.max_staleness"] == "2"
    one = {a.name: dict(a.overrides) for a in ra.arms("mis_sequence", inner_epochs=1)}
    assert one["async4"]["rl.loop.max_ahead"] == "4" and "async2_mis_sequence" in one
    with pytest.raises(ValueError, match="--correction must be one of"):
        ra.arms("none")


def test_overrides_drop_only_an_absent_key_that_means_none():
    arm = ra.Arm("a", (("rl.loop.max_staleness", "2"), ("rl.grpo.correction", "none")))
    corr = ra.Arm("b", (("rl.grpo.correction", "tis_token"),))
    assert ra.cli_overrides(arm, {"rl.loop.max_staleness"}) == ["--rl.loop.max_staleness=2"]
    assert ra.cli_overrides(arm, {"rl.loop.max_staleness", "rl.grpo.correction"})[-1] == (
        "--rl.grpo.correction=none"
    )
    assert ra.cli_overrides(corr, set()) == ["--rl.grpo.correction=tis_token"]


def test_a_key_the_config_lacks_is_a_one_line_skip():
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "examples" / "sort_grpo.toml", ["--rl.loop.no_such_key=1"])
    line = ra.one_line(str(e.value))
    assert "\n" not in line
    assert line.endswith(
        "rl.loop.no_such_key: unknown key; check its spelling against the documented fields"
    )
    assert ra.arm_record({"arm": "replay", "task": "sort4", "skipped": line}) == {
        "arm": "replay",
        "task": "sort4",
        "skipped": line,
    }
    assert JobConfig.model_fields["rl"] is not None  # the keys the bench checks live here


def test_trailing_mean_needs_a_full_window():
    assert ra.trailing([0.0, 0.5, 1.0, 1.0], 2) == [None, 0.25, 0.75, 1.0]


def test_batches_take_each_batch_once_at_its_first_line():
    lines = [step(1, 0.5, 12.0), step(0, 0.25, 10.0), step(0, 0.25, 11.0), step(1, 0.5, 13.0)]
    assert ra.batches(lines) == [(0, 0.25, 10.0), (1, 0.5, 12.0)]


def test_phalanx_figures_from_log_lines():
    t0 = 100.0
    pol = [
        {"event": "start", "t": 101.0},
        step(0, 0.2, 104.0, idle=0.3, staleness=0, version=1),
        step(0, 0.2, 104.5, idle=0.1, staleness=0, version=2),
        step(1, 0.4, 105.0, idle=0.2, staleness=1),
        step(2, 0.8, 106.0, staleness=1),
        step(3, 0.9, 107.0, staleness=2),
    ]
    rol = [
        {"event": "rollout", "idle": 0.5},
        {"event": "rollout", "idle": 0.25},
        {"event": "sync", "replica": "a", "version": 1, "ok": True, "t": 104.02},
        {"event": "sync", "replica": "a", "version": 2, "ok": True, "t": 104.54},
        {"event": "sync"},
    ]
    f = ra.phalanx_figures(t0, pol, rol, threshold=0.6, window=2, per=64)
    # Trailing 2-batch means: -, 0.3, 0.6 (batch 2 reaches 0.6 at t = 106), 0.85.
    assert f["startup_s"] == 4.0
    assert f["time_to_threshold_s"] == 6.0
    assert f["train_s"] == 2.0
    assert f["reached"] is True and f["batches_to_threshold"] == 3
    assert f["batches"] == 4 and f["samples"] == 256
    assert f["trail"] == [[128, 0.3], [192, 0.6], [256, 0.85]]
    assert f["trainer_idle"] == 0.2  # the lines that carry one
    assert f["rollout_idle"] == 0.375
    assert f["sync_effect_s"] == 0.03  # (0.02 + 0.04) / 2, from the lines' times
    assert f["staleness"] == 0.8


def test_figures_without_idle_fields_or_threshold():
    f = ra.phalanx_figures(0.0, [step(0, 0.1, 3.0), step(1, 0.1, 4.0)], [], 0.5, 2, 8)
    assert f["reached"] is False and f["time_to_threshold_s"] is None and f["train_s"] is None
    assert f["startup_s"] == 3.0
    assert (f["trainer_idle"], f["rollout_idle"], f["sync_effect_s"]) == (None, None, None)
    assert ra.curve_figures(0.0, [], 0.5, 2, 8)["startup_s"] is None


def test_reward_at_an_exact_sample_count():
    trail = [[128, 0.3], [192, 0.6]]
    assert ra.reward_at(trail, 192) == 0.6
    assert ra.reward_at(trail, 256) is None


def rec(arm: str, t: float | None, trail: list[list[float]], **kw: object) -> dict:
    samples = int(trail[-1][0]) if trail else 0
    return {"arm": arm, "task": "sort4", "time_to_threshold_s": t, "trail": trail,
            "samples": samples, "startup_s": 5.0, "train_s": None, **kw}  # fmt: skip


def test_compare_ratios_best_arm_and_gaps():
    specs = ra.arms("tis_token", inner_epochs=2)
    results = [
        rec("sync", 100.0, [[64, 0.5], [128, 0.80]]),
        rec("async2", 80.0, [[64, 0.5], [128, 0.70]]),
        rec("async2_tis_token", 60.0, [[64, 0.5], [128, 0.79]], sync_effect_s=0.2),
        rec("waiting", 65.0, [[64, 0.5], [128, 0.78]], sync_effect_s=0.8),
        rec("async4", None, [[64, 0.3], [128, 0.50]]),
        rec("async4_tis_token", 70.0, [[64, 0.3]]),  # stopped short of sync's samples
        {"arm": "replay", "task": "sort4", "skipped": "rl.loop.replay_ratio: unknown key"},
        rec("trl", 200.0, [[64, 0.2]], startup_s=12.0, train_s=188.0),
    ]
    s = ra.compare(results, specs)
    by = {r["arm"]: r for r in results}
    assert by["sync"]["time_to_threshold_ratio_vs_sync"] is None
    assert by["sync"]["final_reward_gap"] is None
    assert by["async2"]["time_to_threshold_ratio_vs_sync"] == 0.8
    assert by["async2_tis_token"]["time_to_threshold_ratio_vs_sync"] == 0.6
    assert by["async4"]["time_to_threshold_ratio_vs_sync"] is None
    assert by["async2"]["final_reward_gap"] == -0.1
    assert by["async2_tis_token"]["final_reward_gap"] == -0.01
    assert by["async4"]["final_reward_gap"] == -0.3
    assert by["async4_tis_token"]["final_reward_gap"] is None
    assert "final_reward_gap" not in by["trl"]  # TRL is no phalanx arm
    assert s["best_async_arm"] == "async2_tis_token"
    assert s["time_to_threshold_ratio_vs_sync"] == 0.6
    assert s["final_reward_gap"] == -0.01
    assert s["no_correction_arm"] == "async2"
    assert s["final_reward_gap_no_correction"] == -0.1
    assert s["final_samples"] == 128
    assert s["best_arm"] == "async2_tis_token"
    assert s["ratio_vs_trl"] == 0.3
    assert (s["sync_effect_s"], s["sync_effect_waiting_s"], s["sync_effect_ratio"]) == (
        0.2,
        0.8,
        0.25,
    )
    assert (s["trl_time_to_threshold_s"], s["trl_startup_s"], s["trl_train_s"]) == (
        200.0,
        12.0,
        188.0,
    )


def test_compare_when_sync_is_best_or_missing():
    specs = ra.arms("tis_token")
    s = ra.compare([rec("sync", 50.0, [[8, 0.9]]), rec("async2", 60.0, [[8, 0.95]])], specs)
    assert s["best_async_arm"] == "async2" and s["no_correction_arm"] == "async2"
    assert s["final_reward_gap"] == s["final_reward_gap_no_correction"] == 0.05
    assert s["best_arm"] == "sync" and s["ratio_vs_trl"] is None
    alone = ra.compare([rec("async4", 30.0, [[8, 0.9]])], specs)
    assert alone["best_async_arm"] == "async4" and alone["time_to_threshold_ratio_vs_sync"] is None
    assert alone["final_reward_gap"] is None


def test_arm_record_has_every_key():
    r = rec("async2", 80.0, [[64, 0.5]], reached=True)
    out = ra.arm_record(r)
    assert list(out) == list(ra.ARM_KEYS)
    assert out["trainer_idle"] is None and out["time_to_threshold_s"] == 80.0


def test_sync_effect_waits_for_the_last_replica_and_counts_skipped_versions():
    steps = [step(0, 0.1, 10.0, version=1), step(0, 0.1, 11.0, version=2)]
    steps += [step(1, 0.2, 12.0, version=3)]
    sync = [
        {"event": "sync", "replica": "a", "version": 1, "ok": True, "t": 10.1},
        {"event": "sync", "replica": "b", "version": 1, "ok": True, "t": 10.5},
        {"event": "sync", "replica": "a", "version": 2, "ok": True, "t": 11.2},
        {"event": "sync", "replica": "b", "version": 3, "ok": True, "t": 12.3},  # skipped 2
        {"event": "sync", "replica": "a", "version": 3, "ok": False, "t": 12.1},  # failed
        {"event": "rollout", "replica": "a", "version": 2, "t": 12.2},
    ]
    # v1: the last replica at 10.5 (0.5 s); v2: b reaches >= 2 at 12.3 (1.3 s);
    # v3: only b holds it (a's sync failed), at 12.3 (0.3 s).
    assert ra.sync_effect(steps, sync) == pytest.approx((0.5 + 1.3 + 0.3) / 3, abs=1e-4)
    assert ra.sync_effect(steps, []) is None
    assert ra.sync_effect([step(0, 0.1, 10.0, version=9)], sync) is None  # never held

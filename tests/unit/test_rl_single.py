"""The single-process GRPO loop learns, and its config and CLI behave."""

from __future__ import annotations

import json

import pytest

from phalanx.config import ConfigError
from phalanx.config.rl import load_rl_config
from phalanx.jobs.rl_single import main, train


def test_short_run_raises_the_reward():
    """A few dozen rounds of GRPO on the sort task lift the mean reward clearly above its start."""
    cfg = load_rl_config(None, ["--grpo.steps", "40"])
    records = train(cfg)
    assert len(records) == 40
    first = sum(r["reward"] for r in records[:5]) / 5
    last = sum(r["reward"] for r in records[-5:]) / 5
    assert last > first + 0.1, (first, last)


def test_one_inner_epoch_is_on_policy():
    """With one optimizer step per round the engine's weights are the trainer's:
    every ratio is 1 and nothing is clipped."""
    overrides = ["--grpo.steps", "3", "--grpo.inner_epochs", "1", "--grpo.prompts_per_step", "4"]
    records = train(load_rl_config(None, overrides))
    assert all(r["clip_frac"] == 0.0 and abs(r["kl_behaviour"]) < 1e-6 for r in records)
    # On policy: the importance weights are 1, and every token is 0 versions stale.
    for r in records:
        assert r["ess"] == pytest.approx(1.0, abs=1e-4) and abs(r["mismatch_kl"]) < 1e-6
        assert r["staleness_tokens"] == {0: round(r["len"] * 4 * 16)}


@pytest.mark.parametrize("correction", ["tis_sequence", "mis_token"])
def test_a_correction_trains_and_reports_its_metrics(correction):
    """The second inner epoch trains rollouts one version old against the round's
    proximal policy, its first step's weights, which sampled them (the single process
    syncs its engine every round): the weights pi_prox/mu are 1, nothing is truncated
    or masked, and the PPO clip acts on pi_theta/pi_prox as it did against mu."""
    overrides = ["--grpo.steps", "2", "--grpo.prompts_per_step", "4"]
    overrides += ["--grpo.correction", correction, "--grpo.is_cap", "1.05"]
    records = train(load_rl_config(None, overrides))
    for r in records:
        assert list(r["staleness_tokens"]) == [1]  # the last inner epoch's
        assert r["ess"] == pytest.approx(1.0, abs=1e-4) and abs(r["mismatch_kl"]) < 1e-6
        assert r["is_clip_frac"] == 0 and r["is_mask_frac"] == 0
        assert 0 <= r["clip_frac"] <= 1
    assert any(r["clip_frac"] > 0 for r in records)


def test_a_replay_ratio_trains_stored_groups_beside_fresh_ones():
    """replay_ratio = 0.5 of 4 prompts: once the replay holds 2 groups, each round
    trains 2 of them (stored completions, from the versions that made them) and 2
    fresh ones; the draws are seeded, so a second run trains the same rounds."""
    overrides = ["--grpo.steps", "4", "--grpo.prompts_per_step", "4", "--grpo.group_size", "4"]
    overrides += ["--grpo.inner_epochs", "1", "--grpo.max_new_tokens", "4"]
    overrides += ["--loop.replay_ratio", "0.5", "--transport.replay", "memory"]
    records = train(load_rl_config(None, overrides))
    assert [r["replayed"] for r in records] == [0, 2, 2, 2]
    assert list(records[0]["staleness_tokens"]) == [0]
    # Round 2 trains at version 2 (one optimizer step a round): its fresh rows are 0
    # versions stale, and the replayed ones 1 or 2 (made in round 0 or 1).
    hist = records[2]["staleness_tokens"]
    assert 0 in hist and set(hist) - {0} and set(hist) <= {0, 1, 2}, hist
    timeless = ("gen_s", "gen_tokens_per_s", "train_tokens_per_s", "step_s", "seconds")
    timeless += ("peak_mem_mb",)  # the process's, which grows
    again = train(load_rl_config(None, overrides))
    drop = [{k: v for k, v in r.items() if k not in timeless} for r in (*records, *again)]
    assert drop[:4] == drop[4:]


def test_a_replay_off_this_process_is_refused_in_one_line():
    from phalanx.jobs.base import JobError

    overrides = ["--loop.replay_ratio", "0.25", "--transport.replay", "redis://127.0.0.1:1/0"]
    with pytest.raises(JobError, match=r"keeps its replay in memory: got rl.transport.replay = "):
        train(load_rl_config(None, overrides))


def test_cli_prints_json_lines(capsys):
    assert (
        main(["--grpo.steps", "2", "--grpo.prompts_per_step", "2", "--grpo.group_size", "4"]) == 0
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["event"] == "start" and lines[-1]["event"] == "summary"
    steps = [line for line in lines if "step" in line]
    assert [s["step"] for s in steps] == [1, 2]
    assert {"reward", "exact_match", "seconds"} <= set(steps[0])


def test_config_from_toml_and_overrides(tmp_path):
    path = tmp_path / "rl.toml"
    path.write_text('[rl.model]\narch = "llama"\n[rl.grpo]\nlr = 0.002\n')
    cfg = load_rl_config(path, ["--grpo.group_size", "8"])
    assert (cfg.model.arch, cfg.grpo.lr, cfg.grpo.group_size) == ("llama", 0.002, 8)
    with pytest.raises(ConfigError, match=r"grpo\.lrr"):
        load_rl_config(None, ["--grpo.lrr", "1"])
    with pytest.raises(ConfigError, match=r"task\.path and task\.reward must both be set"):
        load_rl_config(None, ["--task.name", "jsonl"])
    with pytest.raises(ConfigError, match=r"divisible by model\.num_heads"):
        load_rl_config(None, ["--model.num_heads", "5"])

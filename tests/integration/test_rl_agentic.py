"""An agentic RL job with real processes: the built-in coding environment
(``phalanx.rl.agentic.code_env``: write a function, its tests run in the bubblewrap
sandbox, fix it) on a small Qwen2 with the tool-calling tokenizer, random weights.
A rollout replica is SIGKILLed in the middle of an episode; another replica finishes
its episodes from the turns it reported (replayed, not generated again), the ledger
balances, and no prompt, rollout or turn is trained twice.

Each turn is paced (``rl.loop.chunk_delay_s`` at each of its 4-token chunks), so the
kill finds episodes between their first and last turn."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agentic_models import make_agentic_model
from procs import PROGRESS_S, Controller, Procs, run_to_end, wait_for, write_job_toml
from test_rl import RLReplica, check_ledger, job_sections, rl_status, wait_finished

from phalanx.rl.sandbox.bwrap import BwrapSandbox

STEPS = 3


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        BwrapSandbox()
    except Exception as e:
        pytest.skip(f"no sandbox here: {e}")
    return make_agentic_model(tmp_path_factory.mktemp("agentic") / "model")


@pytest.fixture
def agentic_job(
    tmp_path: Path, procs: Procs, model: Path
) -> Iterator[tuple[Controller, Callable[..., RLReplica]]]:
    sections = job_sections(rollout_init=1, steps=STEPS, target_reward=1e9)
    sections["rl.grpo"].update(prompts_per_step=2, group_size=2, max_new_tokens=16)
    sections["rl.loop"].update(prompts_per_lease=1, lease_s=60.0, sync_timeout_s=6.0)
    sections["rl.engine"] = {"chunk": 4}
    sections["rl.model"] = {"path": str(model)}
    sections["rl.task"] = {"tokenizer_path": str(model)}
    sections["rl.env"] = {"module": "phalanx.rl.agentic.code_env", "max_episode_tokens": 400}
    sections["rl.env.args"] = {"max_turns": 3}
    config = write_job_toml(tmp_path / "agentic.toml", sections)
    ctl = Controller(procs, tmp_path / "state", config).start()

    def start(role: str, name: str, *extra: str) -> RLReplica:
        return RLReplica(procs, ctl, config, role, name, *extra)

    yield ctl, start


def episodes(ctl: Controller) -> dict[str, Any]:
    return rl_status(ctl).get("episodes") or {}


def test_a_rollout_killed_mid_episode_is_finished_by_another_from_its_last_turn(agentic_job):
    ctl, start = agentic_job
    policy = start("policy", "policy-0")
    doomed = start("rollout", "rollout-doomed", "--rl.loop.chunk_delay_s", "0.3")

    def mid_episode() -> bool:
        doomed.alive()
        return episodes(ctl).get("reports", 0) >= 1

    wait_for(mid_episode, PROGRESS_S, "the doomed replica to report a completed turn")
    doomed.kill()
    rescue = start("rollout", "rollout-rescue")
    st = wait_finished(ctl, [policy, rescue], timeout=300.0)
    check_ledger(ctl, st, [policy])
    ep = st["episodes"]
    assert ep["resumed"] >= 1 and ep["turns_carried"] >= 1, ep
    rolls = rescue.events("rollout")
    # Every turn carried to the rescuer was replayed from the report, none generated again.
    assert sum(e["replayed_turns"] for e in rolls) == ep["turns_carried"], (rolls, ep)
    assert sum(e["resumed_episodes"] for e in rolls) >= 1
    assert not rescue.events("abandoned")  # no turn aborted
    # Episodes of several turns: the environment's answers between them.
    assert any(e["turns"] > e["prompts"] * 2 for e in rolls), rolls
    assert ep["held"] == 0  # nothing kept once the rollouts were accepted


@pytest.mark.slow
def test_the_agentic_example_under_chaos(model: Path, tmp_path: Path):
    """``examples/agentic_code.toml`` through ``phalanx run --chaos kill-every=20``: random
    replicas of both roles SIGKILLed and restarted; episodes left mid-way are finished
    from their reported turns, no turn is aborted by a weight update, the ledger
    balances."""
    import json
    import sys

    root = Path(__file__).parents[2]
    args = [sys.executable, "-m", "phalanx.cli", "run", str(root / "examples/agentic_code.toml")]
    args += ["--plain", "--json", "--chaos", "kill-every=20", "--run-dir", str(tmp_path / "run")]
    args += ["--rl.model.path", str(model), "--rl.task.tokenizer_path", str(model)]
    p = run_to_end(args, 900)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert s["ledger_ok"] and s["kills"] >= 3 and s["trained"] == 120, s
    assert s["episodes"]["resumed"] >= 1 and s["episodes"]["turns_carried"] >= 1, s
    rolls = [
        json.loads(line)
        for f in (tmp_path / "run").glob("rollout-*.log")
        for line in f.read_text().splitlines()
        if line.startswith("{") and '"event": "rollout"' in line
    ]
    # (A rescuer killed before it submitted had its carried turns carried again.)
    assert 1 <= sum(e["replayed_turns"] for e in rolls) <= s["episodes"]["turns_carried"]
    assert not any(
        '"event": "abandoned"' in f.read_text() for f in (tmp_path / "run").glob("*.log")
    )

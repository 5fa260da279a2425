"""The RL summary's idle fractions, computed from the replicas' JSON lines as
``phalanx run`` reads them: the policy's mean over its step lines, the rollout
replicas' mean over their rollout lines."""

from __future__ import annotations

import json

from phalanx.console.summary import idle_stats, idle_text, rl_line
from phalanx.launch.replica import Replica

LINES = {
    "policy-0": [
        '{"event": "start", "role": "policy", "replica": "policy-0:a"}',
        '{"event": "step", "role": "policy", "step": 1, "loss": 0.5, "idle": 0.8}',
        '{"event": "step", "role": "policy", "step": 2, "loss": 0.4, "idle": 0.1}',
        '{"event": "retry", "role": "policy", "step": 3, "error": "peer left"}',
        '{"event": "step", "role": "policy", "step": 3, "loss": 0.3, "idle": 0.3}',
    ],
    "rollout-0": [
        '{"event": "rollout", "role": "rollout", "accepted": 4, "idle": 0.5}',
        '{"event": "sync", "role": "rollout", "ok": true, "version": 1, "ms": 3.0}',
        '{"event": "rollout", "role": "rollout", "accepted": 4, "idle": 0.25}',
    ],
    "rollout-1": [
        '{"event": "rollout", "role": "rollout", "accepted": 4, "idle": 0.0}',
    ],
}


def replicas() -> list[Replica]:
    out = []
    for name, lines in LINES.items():
        r = Replica(name, name.split("-")[0])
        for line in lines:
            r.apply(json.loads(line))
        out.append(r)
    return out


def test_idle_fractions_are_the_means_of_the_lines():
    reps = replicas()
    assert reps[0].idle == [0.8, 0.1, 0.3]
    got = idle_stats(reps)
    assert got == {"policy_idle": 0.4, "rollout_idle": 0.25}  # (0.5 + 0.25 + 0.0) / 3
    assert idle_text(got) == ", idle: policy 0.40, rollout 0.25"


def test_lines_without_idle_give_none_and_no_text():
    r = Replica("policy-0")
    r.apply({"event": "step", "step": 1, "loss": 1.0})  # an FT job's step line
    assert idle_stats([r]) == {"policy_idle": None, "rollout_idle": None}
    assert idle_text(idle_stats([r])) == ""


def test_the_summary_line_says_both():
    s = {
        "job": "sort-grpo",
        "target": None,
        "reached": False,
        "batches": 3,
        "wall_s": 9.0,
        "exact_match_avg": 0.5,
        "prompts": 12,
        "trained": 12,
        "discarded": {},
        "kills": 0,
        "heals": 0,
        "syncs": 1,
        "sync_ms_mean": 3.0,
        "ledger_ok": True,
        "error": None,
        "run_dir": "runs/x",
        **idle_stats(replicas()),
    }
    assert rl_line(None, s) == (  # type: ignore[arg-type]
        "job sort-grpo: 3 batches trained in 9.0 s, trailing exact match 0.500; prompts 12, "
        "rollouts trained 12, discarded 0 (none); 0 replica(s) killed, 0 heal(s), syncs 1 "
        "(mean 3.0 ms), idle: policy 0.40, rollout 0.25. Logs: runs/x"
    )

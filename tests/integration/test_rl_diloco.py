"""RL over decoupled DiLoCo (docs/architecture.md, "RL over DiLoCo") under ``phalanx
run``: 2 policy slots (H = 2) and 1 rollout replica that meet only through storage
(``file://`` rollouts, weights and rounds) and the controller's small messages.
The ledger balances, every prompt is trained once and by the slot whose batch it
was, the final weights are θ_global, and a slot SIGKILLed mid-round is survived, and
so is the rollout replica."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from procs import finish_run, start_run, write_job_toml
from safetensors.torch import load_file
from test_rl_launch import GROUP, PROMPTS, summary_of

from phalanx.train.snapshot import unpack_state

SLOTS, H = 2, 2
ROUND = SLOTS * H  # batches per round: the step between two versions
ROUNDS = 4


def rl_diloco_job(tmp_path: Path) -> Path:
    return write_job_toml(
        tmp_path / "job.toml",
        {
            "job": {"id": f"rl-diloco-{tmp_path.name}"[:60]},
            "timeouts": {"collective_s": 10.0, "heartbeat_s": 20.0, "quorum_s": 60.0},
            "controller": {"tick_s": 0.02},
            "roles.policy": {"min_replicas": SLOTS, "n_init_replicas": SLOTS},
            "roles.rollout": {"min_replicas": 1, "n_init_replicas": 1},
            "rl.model": {
                "hidden_size": 32,
                "num_layers": 1,
                "num_heads": 2,
                "intermediate_size": 64,
            },
            "rl.grpo": {
                "steps": ROUNDS * ROUND,
                "prompts_per_step": PROMPTS,
                "group_size": GROUP,
                "inner_epochs": 1,
            },
            "rl.loop": {
                "prompts_per_lease": 2,
                "sync_every": ROUND,
                "max_staleness": 2 * ROUND,
                "window": 2,
                "lease_s": 10.0,
                # Generation slower than two slots train: a slot waits for each batch,
                # so the kill after its round's first inner step lands mid-round.
                "gen_delay_s": 0.1,
            },
            "rl.transport": {
                "rollouts": f"file://{tmp_path}/rollouts",
                "weights": f"file://{tmp_path}/weights",
            },
            "diloco": {
                "mode": "objectstore",
                "url": f"file://{tmp_path}/diloco",
                "replicas": SLOTS,
                "min_replicas": SLOTS,
                "sync_every": H,
            },
        },
    )


def lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict):
            out.append(ev)
    return out


def kill_mid_round(
    slot_log: Path, p: subprocess.Popen[str], rnd: int, victim: Path | None = None
) -> dict[str, Any]:
    """SIGKILL, by the pid of its latest start line, the process writing ``victim``
    (default: the slot itself) once the slot writing ``slot_log`` trained the first
    inner step of round ``rnd``: its round is then half done. Returns that step."""
    victim = victim or slot_log
    while p.poll() is None:
        first = [
            e
            for e in lines(slot_log)
            if e.get("event") == "inner_step" and e["batch"] // SLOTS == rnd * H
        ]
        starts = [e for e in lines(victim) if e.get("event") == "start"]
        if starts and first:
            os.kill(starts[-1]["pid"], signal.SIGKILL)
            return first[0]
        time.sleep(0.01)
    raise AssertionError("the job ended before the kill")


def test_rl_over_diloco_survives_a_slot_and_the_rollout_replica_killed_mid_round(tmp_path: Path):
    config = rl_diloco_job(tmp_path)
    run = tmp_path / "run"
    args = [str(config), "--plain", "--json", "--run-dir", str(run)]
    p = start_run([*args, "--rl.loop.target_exact_match=null"])  # no reward target
    try:
        killed = kill_mid_round(run / "policy-1.log", p, 1)
        # Then the rollout replica, mid-round 2: its new incarnation needs θ_global
        # from the policy leader, which serves sync orders even while it waits for a
        # round's quorum (a `phalanx run --chaos` run once hung there without that).
        kill_mid_round(run / "policy-1.log", p, 2, run / "rollout-0.log")
    finally:
        out, err = finish_run(p, timeout=240)
    assert p.returncode == 0, f"{err[-3000:]}\n{out[-3000:]}"
    s = summary_of(out)
    assert s["ok"] and s["ledger_ok"] and s["batches"] == ROUNDS * ROUND, s
    assert s["trained"] == ROUNDS * ROUND * PROMPTS and s["steps"] == ROUNDS * ROUND

    # The killed slot came back, caught up (no round went on without it), and
    # trained its half-done round's batch again: the same frozen rollouts.
    evs = {k: lines(run / f"policy-{k}.log") for k in range(SLOTS)}
    starts = [e for e in evs[1] if e["event"] == "start"]
    assert len(starts) == 2 and starts[1]["round"] == 1, starts
    again = [e for e in evs[1] if e["event"] == "inner_step" and e["batch"] == killed["batch"]]
    assert len(again) == 2 and again[0]["rollouts"] == again[1]["rollouts"], again

    # Each prompt trained once, each batch by its own slot: the ledger's lineage is
    # batch b = (r·H + h)·S + k, trained last by slot k with exactly those rollouts.
    with sqlite3.connect(run / "controller" / "journal.sqlite") as db:
        lineage = {
            int(k): json.loads(v)["rollouts"]
            for k, v in db.execute("select key, value from records where tbl = 'lineage'")
        }
    assert sorted(lineage) == list(range(ROUNDS * ROUND))
    prompts = [rid.split(".")[0] for ids in lineage.values() for rid in ids]
    assert len(prompts) == len(set(prompts)) == ROUNDS * ROUND * PROMPTS
    trained: dict[int, list[str]] = {}
    for k in range(SLOTS):
        for e in evs[k]:
            if e["event"] == "inner_step":
                assert e["batch"] % SLOTS == k, e
                trained[e["batch"]] = e["rollouts"]
    assert trained == lineage

    # Versions are whole rounds: every round was decided with both slots, and the
    # rollout replica only ever synced to θ_global of a round.
    for k in range(SLOTS):
        rounds = [e for e in evs[k] if e["event"] == "step"]
        assert all(e["members"] == ["r0", "r1"] and e["step"] % ROUND == 0 for e in rounds)
    rollout = lines(run / "rollout-0.log")
    assert len([e for e in rollout if e["event"] == "start"]) == 2
    synced = [e["version"] for e in rollout if e["event"] == "sync" and e["ok"]]
    assert synced and all(v % ROUND == 0 and v > 0 for v in synced), synced

    # The final weights are θ_global: the same in both slots' files, and the outer
    # state each slot saved after the last round.
    finals = [load_file(run / "final" / f"policy-{k}.safetensors") for k in range(SLOTS)]
    assert finals[0].keys() == finals[1].keys()
    assert all(torch.equal(finals[0][n], finals[1][n]) for n in finals[0])
    (root,) = (tmp_path / "diloco").iterdir()  # this run's: <job id>.<ledger run>
    for k in range(SLOTS):
        blob = (root / "replicas" / f"r{k}.st").read_bytes()
        state = unpack_state(blob, f"r{k}.st")
        assert state["diloco"]["rounds"] == ROUNDS
        for n, g in state["diloco"]["global"].items():
            assert torch.equal(finals[k][f"model.{n}"], g.to(finals[k][f"model.{n}"].dtype)), n


def test_rl_over_diloco_ends_with_the_round_that_met_the_target(tmp_path: Path):
    """A reward target is met at a batch, but only a round's ack can meet it (the
    ledger counts trained batches round by round): the job ends there, with every
    batch of that round trained, and no batch of a later one."""
    config = rl_diloco_job(tmp_path)
    run = tmp_path / "run"
    args = [str(config), "--plain", "--json", "--run-dir", str(run)]
    p = start_run([*args, "--rl.loop.target_exact_match=null", "--rl.loop.target_reward=1e-9"])
    out, err = finish_run(p, timeout=240)
    assert p.returncode == 0, f"{err[-3000:]}\n{out[-3000:]}"
    s = summary_of(out)
    assert s["ok"] and s["ledger_ok"] and s["reached"], s
    with sqlite3.connect(run / "controller" / "journal.sqlite") as db:
        lineage = [int(k) for (k,) in db.execute("select key from records where tbl = 'lineage'")]
    assert lineage and len(lineage) % ROUND == 0 and sorted(lineage) == list(range(len(lineage)))
    assert s["trained"] == len(lineage) * PROMPTS
    for k in range(SLOTS):
        (done,) = [e for e in lines(run / f"policy-{k}.log") if e["event"] == "done"]
        assert done["step"] == len(lineage) and done["finished"], done

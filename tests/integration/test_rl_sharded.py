"""The RL job with sharded policy replicas (``[replica] ranks = 2``): each policy
replica is two ranks started by ``phalanx.launch.ranks``, FSDP2 over gloo inside
it, fault tolerance across replicas. Real processes and real SIGKILLs of one rank.

- The GRPO step of a sharded replica equals an unsharded one's (float64, to
  1e-12), including a rank that runs filler micro-batches to pair FSDP's
  collectives, and the weights a sharded leader sends are the whole model,
  gathered one tensor at a time into the one buffer it sends.
- Two sharded policy replicas: one loses a rank mid-run, the whole replica
  stops, the other goes on alone, and the replica comes back and trains beside
  it again (healed shard by shard, or resumed at the group's step). The ledger
  balances, and both end with the same weights.
- A lone sharded policy replica loses a rank: it resumes from its own sharded
  checkpoint, retrains no acknowledged batch, and ``phalanx ckpt export`` turns
  that checkpoint into the whole model it ended with.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from procs import PROGRESS_S, Controller, Procs, wait_for, write_job_toml
from safetensors.torch import load_file
from test_rl import RLReplica, check_ledger, job_sections, rl_status, wait_finished

from phalanx.launch.ranks import rank_pids
from phalanx.train.snapshot import load_state

HERE = Path(__file__).parent
HELD_TIMEOUTS = {"heartbeat_s": 30.0, "suspect_grace_s": 1.0, "quorum_s": 60.0}
"""The survivor is held (SIGSTOP) while the stopped replica comes back, as in
test_hsdp.py: a dead replica is found by the survivor's failed collective and a
probe it cannot answer, so a long heartbeat timeout does not slow its eviction."""


def sharded_job(tmp_path: Path, procs: Procs, **kw: Any) -> tuple[Controller, Path]:
    sections = job_sections(**kw)
    sections["replica"] = {"ranks": 2}
    sections["timeouts"].update(HELD_TIMEOUTS)
    config = write_job_toml(tmp_path / "rl.toml", sections)
    return Controller(procs, tmp_path / "state", config).start(), config


def kill_a_rank(p: RLReplica) -> None:
    """SIGKILL rank 1 of ``p``'s replica; the replica must stop as a whole, in one line."""
    os.kill(rank_pids(p.proc.pid)[1], signal.SIGKILL)
    assert p.proc.wait(timeout=120) != 0
    err = p.err.read_text(errors="replace")
    assert "stopping the replica's other ranks" in err or "the replica stops" in err, err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_a_sharded_policy_step_equals_an_unsharded_one(tmp_path: Path):
    out = tmp_path / "numerics.json"
    cmd = [sys.executable, "-m", "phalanx.launch.ranks", "--nproc", "2", "--"]
    cmd += [sys.executable, str(HERE / "rl_shard_worker.py"), str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=PROGRESS_S)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["rows"] == 9 and got["grad_norm"] > 0  # (rank 1: 2 micro-batches and a filler)
    assert got["grad_diff"] < 1e-12, got
    assert got["norm_diff"] < 1e-12 and got["clipped_diff"] < 1e-12, got  # (clip_grad_norm)
    assert got["tokens"] == got["tokens_plain"]
    assert got["names_equal"] and got["weights_diff"] == 0.0, got
    assert got["packed_in_place"], "the leader's snapshot was copied again to be sent"


def test_sharded_policy_replicas_lose_a_rank_and_the_replica_comes_back(
    tmp_path: Path, procs: Procs
):
    # A fixed 30 batches (the reward target is out of reach).
    ctl, config = sharded_job(
        tmp_path, procs, policy_init=2, rollout_init=1, steps=30, target_reward=0.99
    )

    def start(name: str, spare: bool = False) -> RLReplica:
        out = ["--out", str(tmp_path / f"{name}-{'spare' if spare else 'first'}.safetensors")]
        return RLReplica(procs, ctl, config, "policy", name, *out, spare=spare, ranks=2)

    a, b = start("policy-a"), start("policy-b")
    roll = RLReplica(procs, ctl, config, "rollout", "rollout-0")
    b2 = start("policy-b", spare=True)  # warm: a cold start of two ranks takes long here
    wait_for(
        lambda: (
            a.alive() and any(e["participants"] == 2 and e["step"] >= 4 for e in a.events("step"))
        ),
        PROGRESS_S,
        "the two sharded policy replicas to train together",
    )
    kill_a_rank(b)
    at_kill = rl_status(ctl)["policy_step"]
    alone = wait_for(
        lambda: [e for e in a.events("step") if e["participants"] == 1 and e["step"] > at_kill],
        PROGRESS_S,
        "policy-a to train alone",
    )[0]
    os.killpg(a.proc.pid, signal.SIGSTOP)  # (b2 joins the group a is in)
    try:
        b2.release()
        wait_for(
            lambda: any(
                m["replica_id"].startswith("policy-b:")
                and m["replica_id"] != b.events("start")[0]["replica"]
                for m in ctl.status()["roles"]["policy"]["replicas"]
            ),
            PROGRESS_S,
            "the restarted policy-b to register",
        )
    finally:
        os.killpg(a.proc.pid, signal.SIGCONT)
    back = wait_for(
        lambda: [e for e in b2.events("step") if e["participants"] == 2] or not b2.alive(),
        PROGRESS_S,
        "the restarted policy-b to train beside policy-a",
    )
    assert back is not True, "policy-b's restart exited before training"
    assert back[0]["step"] > alone["step"]
    assert back[0]["healed"] or "resumed from" in b2.err.read_text(), back[0]
    st = wait_finished(ctl, [a, b2, roll], timeout=PROGRESS_S)
    check_ledger(ctl, st, [a, b, b2])
    # The rollout replica got every version from a sharded leader, whole.
    syncs = [e for p in (a, b, b2) for e in p.events("sync")]
    assert syncs and all(e["ok"] for e in syncs[-3:]), syncs[-3:]
    # (A sync cut short by the kill reports ok = false and no bytes; the next one
    # sends the version again.)
    assert len({e["bytes"] for e in syncs if e["ok"]}) == 1, syncs
    versions = [e["version"] for e in roll.events("rollout")]
    assert versions == sorted(versions) and versions[-1] > 0
    fa = load_state(tmp_path / "policy-a-first.safetensors")
    fb = load_state(tmp_path / "policy-b-spare.safetensors")
    assert fa["step"] == fb["step"] > 0 and fa["model"].keys() == fb["model"].keys()
    same = all(bool((fa["model"][k] == fb["model"][k]).all()) for k in fa["model"])
    assert same, "the two replicas ended apart"


def test_a_lone_sharded_policy_resumes_from_its_sharded_checkpoint(tmp_path: Path, procs: Procs):
    ctl, config = sharded_job(tmp_path, procs, rollout_init=1, steps=12, target_reward=0.99)
    out = tmp_path / "policy.safetensors"
    p = RLReplica(procs, ctl, config, "policy", "policy-0", "--out", str(out), ranks=2)
    roll = RLReplica(procs, ctl, config, "rollout", "rollout-0")
    wait_for(lambda: rl_status(ctl)["policy_step"] >= 4 and p.alive(), PROGRESS_S, "step 4")
    kill_a_rank(p)
    acked = rl_status(ctl)["policy_step"]
    p2 = RLReplica(procs, ctl, config, "policy", "policy-0", "--out", str(out), ranks=2)
    st = wait_finished(ctl, [p2, roll], timeout=PROGRESS_S)
    check_ledger(ctl, st, [p, p2])
    assert "resumed from" in p2.err.read_text()
    assert p2.events("step")[0]["step"] > acked  # nothing acknowledged is trained again
    state = procs.workdir / "policy-state"
    manifest = json.loads(
        next(iter(sorted(state.glob("step-*/phalanx.json"), reverse=True))).read_text()
    )
    assert manifest["layout"]["ranks"] == 2 and manifest["world_size"] == 2
    # The sharded checkpoint exports as the whole model the replica ended with.
    export = tmp_path / "export.safetensors"
    cmd = [sys.executable, "-m", "phalanx.cli", "ckpt", "export", "--format", "safetensors"]
    done = subprocess.run([*cmd, str(state), str(export)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    exported, final = load_file(export), load_state(out)["model"]
    assert exported.keys() == final.keys()
    assert all(bool((exported[k] == final[k]).all()) for k in final)

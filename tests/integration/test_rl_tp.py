"""The RL job with tensor-parallel policy replicas (``[replica] ranks = N, tp = T``):
a llama policy built from config, TP over T ranks and FSDP2 over N / T, fault
tolerance across replicas. Real processes, real SIGKILLs of one rank.

- The GRPO step of a TP x FSDP replica (4 ranks: TP over 2, FSDP over 2, so the
  parameters are 2-D DTensors) equals an unsharded one's (float64), its loss and
  tokens are counted once per TP group, and the weights its leader sends are the
  whole model, gathered one tensor at a time into the one buffer it sends.
- A lone policy replica of ``ranks = 2, tp = 2`` trains with a rollout replica
  that takes its weights through storage, loses a rank mid-run, resumes from its
  own TP checkpoint, and the ledger balances; the last version the rollout
  replica could fetch is, byte for byte, the policy's gathered final weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from procs import PROGRESS_S, Controller, Procs, wait_for, write_job_toml
from safetensors.torch import load_file
from test_rl import RLReplica, check_ledger, job_sections, rl_status, wait_finished
from test_rl_sharded import HELD_TIMEOUTS, kill_a_rank

from phalanx.train.snapshot import load_state

HERE = Path(__file__).parent


def test_a_tp_policy_step_equals_an_unsharded_one(tmp_path: Path):
    out = tmp_path / "numerics.json"
    cmd = [sys.executable, "-m", "phalanx.launch.ranks", "--nproc", "4", "--"]
    cmd += [sys.executable, str(HERE / "rl_shard_worker.py"), str(out), "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=PROGRESS_S)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    assert got["dtensor_dims"] == 2, got  # TP and FSDP: (dp, tp) DTensors
    assert got["rows"] == 9 and got["grad_norm"] > 0
    assert got["grad_diff"] < 1e-12, got
    assert got["norm_diff"] < 1e-12 and got["clipped_diff"] < 1e-12, got  # (clip_grad_norm)
    assert got["tokens"] == got["tokens_plain"], got  # (once per TP group)
    assert got["names_equal"] and got["weights_diff"] == 0.0, got
    assert got["packed_in_place"], "the leader's snapshot was copied again to be sent"


def tp_job(tmp_path: Path, procs: Procs, **kw: object) -> tuple[Controller, Path]:
    sections = job_sections(**kw)  # type: ignore[arg-type]
    sections["replica"] = {"ranks": 2, "tp": 2}
    sections["rl.model"] = {"arch": "llama"}
    sections["rl.transport"] = {"weights": f"file://{tmp_path}/weights"}
    sections["timeouts"].update(HELD_TIMEOUTS)
    config = write_job_toml(tmp_path / "rl.toml", sections)
    return Controller(procs, tmp_path / "state", config).start(), config


def test_a_lone_tp_policy_loses_a_rank_and_resumes(tmp_path: Path, procs: Procs):
    ctl, config = tp_job(tmp_path, procs, rollout_init=1, steps=8, target_reward=0.99)
    out = tmp_path / "policy.safetensors"
    p = RLReplica(procs, ctl, config, "policy", "policy-0", "--out", str(out), ranks=2)
    roll = RLReplica(procs, ctl, config, "rollout", "rollout-0")
    wait_for(lambda: rl_status(ctl)["policy_step"] >= 4 and p.alive(), PROGRESS_S, "step 4")
    assert p.events("start")[0]["ranks"] == 2
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
    assert manifest["layout"]["ranks"] == 2 and manifest["layout"]["tp"] == 2
    # The rollout replica took TP-gathered versions, and the last one published is
    # the policy's final weights, whole.
    syncs = [e for e in roll.events("sync") if e["ok"]]
    assert syncs and syncs[-1]["version"] > 0, roll.events("sync")
    final = load_state(out)
    published = json.loads((tmp_path / "weights" / "manifest.json").read_text())
    latest = published["latest"]
    assert latest == final["step"], (latest, final["step"])
    sent = load_file(tmp_path / "weights" / published["versions"][str(latest)]["file"])
    assert sent.keys() == final["model"].keys()
    assert all(bool((sent[k] == final["model"][k]).all()) for k in sent)

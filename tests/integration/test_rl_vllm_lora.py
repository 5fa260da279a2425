"""LoRA on the RL job with a vLLM rollout replica (``rl.engine.kind = "vllm"``,
``[rl.lora]``), with real processes: a controller, a policy replica and a rollout
replica whose engine serves the adapter through vLLM's ``LoRARequest``
(``rl/engine/vllm_lora.py``).

The policy trains a 2-layer llama (vLLM has no LoRA layers for gpt2) for a few
steps; every weight sync carries only the adapter's bytes, each lands in vLLM,
and the rollouts generated after a sync carry the adapter's version.
"""

from __future__ import annotations

from typing import Any

import pytest
from procs import Controller, Procs, write_job_toml
from test_rl import RLReplica, check_ledger, job_sections, wait_finished

from phalanx.config.rl import RLConfig
from phalanx.rl.lora import adapter_state, apply_lora, nbytes
from phalanx.rl.model import build_model
from phalanx.rl.tokenizer import task_tokenizer

pytest.importorskip("vllm", reason="vLLM is not installed (make install installs it)")

LORA = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "gate_proj"]}
# llama, head size 32 (vLLM's CPU attention has no kernel for 16).
MODEL = {"arch": "llama", "num_heads": 2}


def sizes() -> tuple[int, int]:
    """(the adapter's bytes, the whole model's bytes) of the job's policy."""
    rl = RLConfig.model_validate({"lora": LORA, "model": MODEL})
    model = build_model(rl.model, task_tokenizer(rl.task))
    whole = nbytes(model.state_dict())
    assert rl.lora is not None
    return nbytes(adapter_state(apply_lora(model, rl.lora, 0))), whole


def test_a_vllm_rollout_replica_serves_the_synced_adapter(tmp_path, procs: Procs):
    sections: dict[str, dict[str, Any]] = job_sections(steps=4, target_reward=0.99)
    sections["rl.lora"] = dict(LORA)
    sections["rl.model"] = dict(MODEL)
    sections["rl.engine"] = {"kind": "vllm"}
    config = write_job_toml(tmp_path / "rl.toml", sections)
    ctl = Controller(procs, tmp_path / "state", config).start()
    adapter, whole = sizes()
    assert adapter * 20 < whole  # (the test's premise: r = 4 on a 64-wide model)
    pol = RLReplica(procs, ctl, config, "policy", "policy-0")
    roll = RLReplica(procs, ctl, config, "rollout", "rollout-0")
    st = wait_finished(ctl, [pol, roll], timeout=600)
    check_ledger(ctl, st, [pol])
    assert [e["engine"] for e in roll.events("start")] == ["vllm"]
    syncs = pol.events("sync")
    assert syncs and all(e["ok"] and e["bytes"] == adapter for e in syncs), syncs
    # Each sync landed in vLLM, and tokens were sampled from synced adapters (version
    # 0 is the zero adapter, the policy's init) and from no other version.
    landed = roll.events("sync")
    assert landed and all(e["ok"] for e in landed), landed
    used = {v for e in roll.events("rollout") for v in e["versions"]}
    assert max(used) > 0 and used <= {0} | {e["version"] for e in landed}, (used, landed)

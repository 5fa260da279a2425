"""LoRA on the RL job (``[rl.lora]``) with real processes: a controller, policy
replicas and a rollout replica (HF engine) running ``phalanx replica``.

- A weight sync carries only the adapter: every ``sync`` event's bytes are the
  adapter's, a small fraction of the model's.
- A SIGKILLed policy replica, restarted (no checkpoint to resume from), heals its
  adapter from its peer: the heal carries the adapter and its AdamW moments only.
- ``phalanx ckpt export --format hf`` of the policy's checkpoint merges the adapter
  into a full HF directory, and that model generates the same greedy tokens as an
  engine serving the adapter (the rollout replicas' engine, fed the checkpoint's
  adapter).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from procs import PROGRESS_S, Controller, Procs, child_env, wait_for, write_job_toml
from test_rl import (
    SPARE,
    RLReplica,
    check_ledger,
    job_sections,
    rl_status,
    wait_finished,
)

from phalanx.config.rl import RLConfig
from phalanx.rl.engine.factory import rollout_engine
from phalanx.rl.lora import adapter_state, apply_lora, nbytes
from phalanx.rl.model import build_model, load_model
from phalanx.rl.tokenizer import task_tokenizer

LORA = {"r": 4, "alpha": 8, "target_modules": ["c_attn", "c_fc"]}


def lora_sections(**kw: Any) -> dict[str, dict[str, Any]]:
    sections = job_sections(**kw)
    sections["rl.lora"] = dict(LORA)
    return sections


def sizes(sections: dict[str, dict[str, Any]]) -> tuple[int, int]:
    """(the adapter's bytes, the whole model's bytes) of the job's policy."""
    rl = RLConfig.model_validate({"lora": LORA, "model": sections.get("rl.model", {})})
    tok = task_tokenizer(rl.task)
    model = build_model(rl.model, tok)
    whole = nbytes(model.state_dict())
    assert rl.lora is not None
    return nbytes(adapter_state(apply_lora(model, rl.lora, 0))), whole


def events(out: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in out.read_text().split("\n")[:-1] if x.startswith("{")]


def stateless_policy(
    procs: Procs, ctl: Controller, config: Path, name: str, spare: bool = False
) -> Any:
    """A policy replica without ``--state``: a restart can only heal from a peer. A
    ``spare`` waits, imports done, for a line on stdin (test_rl's SPARE)."""
    head = ["-c", SPARE] if spare else ["-m", "phalanx.cli"]
    args = [sys.executable, *head, "replica", "--role", "policy", "--name", name]
    args += ["--controller", str(ctl.state_dir), "--config", str(config)]
    stdin = subprocess.PIPE if spare else subprocess.DEVNULL
    return procs.spawn(args, f"policy-{name}", stdin=stdin)


def test_lora_sync_carries_the_adapter_and_a_killed_policy_heals_it(tmp_path, procs: Procs):
    # A fixed 40 batches (the reward target is out of reach), paced, so that the job
    # still runs when the restarted replica joins.
    sections = lora_sections(policy_init=2, steps=40, target_reward=0.99)
    sections["rl.loop"].update(gen_delay_s=0.02)
    config = write_job_toml(tmp_path / "rl.toml", sections)
    ctl = Controller(procs, tmp_path / "state", config).start()
    adapter, whole = sizes(sections)
    assert adapter * 20 < whole  # (the test's premise: r = 4 on a 64-wide model)
    p0 = stateless_policy(procs, ctl, config, "policy-0")
    p1 = stateless_policy(procs, ctl, config, "policy-1")
    roll = RLReplica(procs, ctl, config, "rollout", "rollout-0")
    wait_for(lambda: rl_status(ctl)["policy_step"] >= 4, PROGRESS_S, "policy step 4")
    p1b = stateless_policy(procs, ctl, config, "policy-1", spare=True)
    p1[0].kill()  # SIGKILL, the replica is one process
    p1[0].wait(10)
    at_kill = rl_status(ctl)["policy_step"]
    assert p1b[0].stdin is not None
    p1b[0].stdin.write(b"go\n")
    p1b[0].stdin.close()

    def healed() -> re.Match[str] | None:
        if p0[0].poll() is not None:
            raise AssertionError(f"policy-0 exited ({p0[0].returncode}) before the heal")
        return re.search(
            r"healed from \S+ to step (\d+) in \S+ s \((\d+) bytes", p1b[2].read_text()
        )

    got = wait_for(healed, PROGRESS_S, "the restarted policy-1 to heal from policy-0")
    assert int(got.group(1)) > at_kill
    # Adapter + AdamW's two moments, plus the step counters, RNG and scheduler: no base.
    assert 3 * adapter <= int(got.group(2)) < 3 * adapter + (64 << 10) < whole
    wait_finished(ctl, [roll], timeout=300)
    for p in (p0, p1b):
        assert p[0].wait(60) == 0, p[2].read_text()[-3000:]
    syncs = [e for p in (p0, p1b) for e in events(p[1]) if e["event"] == "sync"]
    assert syncs and all(e["ok"] and e["bytes"] == adapter for e in syncs), syncs


CLI = [sys.executable, "-m", "phalanx.cli"]


def _export_hf(state: Path, config: Path, out: Path) -> str:
    p = subprocess.run(
        [*CLI, "ckpt", "export", str(state), str(out), "--format", "hf", "--config", str(config)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout


def test_merged_export_generates_what_the_adapter_serving_engine_does(tmp_path, procs: Procs):
    sections = lora_sections(steps=3, target_reward=0.99)
    config = write_job_toml(tmp_path / "rl.toml", sections)
    ctl = Controller(procs, tmp_path / "state", config).start()
    pol = RLReplica(procs, ctl, config, "policy", "policy-0")
    roll = RLReplica(procs, ctl, config, "rollout", "rollout-0")
    st = wait_finished(ctl, [pol, roll], timeout=300)
    check_ledger(ctl, st, [pol])
    out = tmp_path / "merged"
    said = _export_hf(procs.workdir / "policy-state", config, out)
    assert "merged" in said, said
    merged = load_model(out)  # a plain HF causal LM: AutoModelForCausalLM.from_pretrained
    assert not any("lora" in k for k in merged.state_dict())

    from safetensors.torch import load_file

    rl = RLConfig.model_validate({"lora": LORA})
    tok = task_tokenizer(rl.task)
    adapter = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    engine = rollout_engine(rl, tok, build_model(rl.model, tok), torch.device("cpu"), "t")
    engine.load_weights(adapter, 3)
    prompts = [tok.encode(p) for p in ("3142>", "9081>", "5555>")]
    from phalanx.rl.engine.hf import HFEngine

    plain = HFEngine(merged, tok.eos_id, tok.pad_id, version=0)
    a = engine.generate(prompts, 1, 8, temperature=0.0)
    b = plain.generate(prompts, 1, 8, temperature=0.0)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    # The adapter moved the model: the merged export is not the base.
    base = HFEngine(build_model(rl.model, tok), tok.eos_id, tok.pad_id, version=0)
    assert merged.state_dict().keys() == base.model.state_dict().keys()
    assert any(
        not torch.equal(v, base.model.state_dict()[k]) for k, v in merged.state_dict().items()
    )

"""Real checkpoints: Qwen2 and Llama causal LMs built from config and saved with a
tokenizer by ``examples/make_model.py`` (as a user's checkpoint would be), loaded by
the policy, the HF engine and vLLM; chat-template prompts; tokenizer agreement;
one-line errors for directories that are not causal LMs; and an RL job on the
arithmetic dataset of ``examples/make_arithmetic.py`` that runs to its end with
its ledger balanced."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from procs import child_env, run_to_end

from phalanx.config import ConfigError
from phalanx.config.rl import ModelSection, load_rl_config
from phalanx.rl.engine.base import prompt_key
from phalanx.rl.engine.hf import HFEngine
from phalanx.rl.model import build_model
from phalanx.rl.tokenizer import HFTokenizer, load_tokenizer

EXAMPLES = Path(__file__).parents[2] / "examples"


def script(name: str, *args: str) -> None:
    subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        check=True,
        env=child_env(),
        capture_output=True,
    )


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """The arithmetic data; a Qwen2 model whose tokenizer learned it; a Llama model with
    a tokenizer of its own (the built-in sentences: another vocabulary)."""
    d = tmp_path_factory.mktemp("models")
    script("make_arithmetic.py", str(d / "arith.jsonl"), "--n", "200")
    script("make_model.py", str(d / "qwen2"), "--data", str(d / "arith.jsonl"))
    script("make_model.py", str(d / "llama"), "--arch", "llama")
    yield {"data": d / "arith.jsonl", "qwen2": d / "qwen2", "llama": d / "llama"}


QUESTION = "Ana has 7 pears and gets 5 more. How many pears does Ana have now?"


@pytest.mark.parametrize(("arch", "cls"), [("qwen2", "Qwen2"), ("llama", "Llama")])
def test_a_saved_checkpoint_loads_and_generates_from_chat_prompts(made, arch: str, cls: str):
    tok = load_tokenizer(made[arch], chat=True, system_prompt="Be brief.")
    assert isinstance(tok, HFTokenizer)
    model = build_model(ModelSection(path=str(made[arch])), tok)
    assert type(model).__name__ == f"{cls}ForCausalLM"
    ids = tok.encode_prompt(QUESTION)
    text = tok.tok.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nAna")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert tok.encode(QUESTION) != ids  # plain prompts stay plain
    engine = HFEngine(model, tok.eos_id, tok.pad_id)
    comps = engine.generate([ids], 3, 6, 1.0, [prompt_key(0, 0)])
    assert len(comps) == 3 and all(c.prompt_ids == ids for c in comps)
    assert all(1 <= len(c.token_ids) <= 6 for c in comps)
    assert all(isinstance(tok.decode(c.token_ids), str) for c in comps)


def test_a_tokenizer_that_is_not_the_models_own_is_one_line(made):
    with pytest.raises(ValueError, match="must hold the same tokenizer") as e:
        build_model(ModelSection(path=str(made["llama"])), load_tokenizer(made["qwen2"]))
    assert "\n" not in str(e.value) and "first difference" in str(e.value)
    with pytest.raises(ValueError, match=r"set task\.tokenizer_path = "):
        build_model(ModelSection(path=str(made["qwen2"])), load_tokenizer(None))


def test_directories_that_are_not_causal_lms_are_one_line(tmp_path: Path, made):
    tok = load_tokenizer(made["qwen2"])
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(
        json.dumps({"architectures": ["BertModel"], "model_type": "bert"})
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    for path, message in [
        (bert, r"must hold a causal LM: its config.json names \['BertModel'\]"),
        (empty, "must hold a saved model: it has no config.json"),
        (tmp_path / "nope", "must be an existing local directory"),
    ]:
        with pytest.raises(ValueError, match=message) as e:
            build_model(ModelSection(path=str(path)), tok)
        assert "\n" not in str(e.value)


def test_chat_needs_a_template_and_a_system_prompt_needs_chat(tmp_path: Path, made):
    plain = tmp_path / "plain"
    plain.mkdir()
    for f in made["qwen2"].glob("tokenizer*"):
        (plain / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"task\.chat needs a tokenizer with a chat template"):
        load_tokenizer(plain, chat=True)
    with pytest.raises(ValueError, match=r"task\.tokenizer_path is unset"):
        load_tokenizer(None, chat=True)
    toml = tmp_path / "rl.toml"
    toml.write_text('[task]\nsystem_prompt = "hi"\n')
    with pytest.raises(ConfigError, match=r"task\.system_prompt needs task\.chat = true"):
        load_rl_config(toml)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_vllm_serves_the_saved_checkpoint_greedy_as_the_hf_engine(made):
    from phalanx.rl.engine.factory import rollout_engine

    rl = load_rl_config(
        None,
        [
            "--engine.kind=vllm",
            f"--model.path={made['qwen2']}",
            f"--task.tokenizer_path={made['qwen2']}",
            "--task.chat=true",
        ],
    )
    tok = load_tokenizer(made["qwen2"], chat=True)
    model = build_model(rl.model, tok)
    engine = rollout_engine(rl, tok, model, torch.device("cpu"), f"models-{id(made)}")
    try:
        engine.version = 0
        prompts = [tok.encode_prompt(q) for q in (QUESTION, "What is 6 times 7?")]
        ours = engine.generate(prompts, 1, 8, 0.0)
        ref = HFEngine(model, tok.eos_id, tok.pad_id).generate(prompts, 1, 8, 0.0)
        assert [c.token_ids for c in ours] == [c.token_ids for c in ref]
    finally:
        engine.close()


def test_an_rl_job_on_the_math_dataset_runs_to_its_end(made, tmp_path: Path):
    """examples/math_grpo.toml on the models made here, shortened: 1 policy, 2 rollout
    replicas, 3 batches; one row's reward function raises, so that row's rollouts are
    discarded with the reason and the job still ends with its ledger balanced. The
    policy trains in micro-batches of 3 under bf16 autocast with activation
    checkpointing, and the metrics land in TensorBoard event files in the run dir."""
    (tmp_path / "flaky_reward.py").write_text(
        "def flaky(prompt, completion, answer):\n"
        "    if prompt.startswith('Ana has'):\n"
        "        raise ArithmeticError('no rule for Ana')\n"
        "    return 0.0\n"
    )
    data = tmp_path / "arith.jsonl"
    rows = [json.loads(x) for x in made["data"].read_text().splitlines()[:12]]
    rows[1]["question"] = QUESTION + " Give the final answer after ####."
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [sys.executable, "-m", "phalanx.cli", "run", str(EXAMPLES / "math_grpo.toml")]
    args += ["--plain", "--json", "--run-dir", str(tmp_path / "run")]
    args += [f"--rl.model.path={made['qwen2']}", f"--rl.task.tokenizer_path={made['qwen2']}"]
    args += [f"--rl.task.path={data}", "--rl.grpo.steps=3", "--rl.grpo.max_new_tokens=8"]
    args += ['--rl.task.rewards=["math", "flaky_reward:flaky"]']
    args += ["--rl.grpo.micro_batch_size=3", "--rl.grpo.precision=bf16"]
    args += ["--rl.grpo.activation_checkpointing=true"]
    env = child_env()
    env["PYTHONPATH"] = f"{tmp_path}:{env.get('PYTHONPATH', '')}"
    p = run_to_end(args, 600, env=env)
    assert p.returncode == 0, f"{p.stderr[-3000:]}\n{p.stdout[-3000:]}"
    s: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    assert s["event"] == "summary" and s["ledger_ok"] and s["batches"] == 3
    assert s["trained"] == 3 * 8
    assert s["discarded"].get("reward_error", 0) >= 1, s
    assert " tok/s" in p.stdout  # the progress line
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    want = {"rl/reward", "rl/exact_match", "policy/entropy", "policy/kl_behaviour"}
    want |= {"perf/tokens_per_s", "perf/train_tokens_per_s", "perf/peak_mem_mb"}
    want |= {"discarded/reward_error"}
    assert want <= tags, tags
    assert [e.step for e in acc.Scalars("rl/reward")] == [0, 1, 2]
    assert [e.step for e in acc.Scalars("perf/tokens_per_s")] == [1, 2]
    assert all(e.value > 0 for e in acc.Scalars("perf/train_tokens_per_s"))
    assert "perf/mfu" not in tags  # a CPU has no peak to measure against

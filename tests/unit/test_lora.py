"""LoRA (``[rl.lora]``, ``[train.lora]``): its config's bounds, the one-line refusal of
target modules that match nothing, what the adapter's state holds, and the HF
engine's merge of an adapter (the peft model's own forward, to float rounding)."""

from __future__ import annotations

import pytest
import torch

from phalanx.config import ConfigError
from phalanx.config.model import LoraSection, ModelSection
from phalanx.config.rl import TaskSection, load_rl_config
from phalanx.rl.lora import MergedAdapter, adapter_state, apply_lora, nbytes
from phalanx.rl.model import build_model
from phalanx.rl.tokenizer import task_tokenizer
from phalanx.train.trainable import load_trainable, trainable_state


def test_absent_section_means_no_lora_and_the_defaults_are_valid():
    assert load_rl_config().lora is None
    rl = load_rl_config(overrides=["--lora.r", "8"])
    assert rl.lora is not None and rl.lora.r == 8 and rl.lora.dropout == 0.0


@pytest.mark.parametrize(
    ("override", "says"),
    [
        (["--lora.r", "0"], "lora.r"),
        (["--lora.alpha", "0"], "lora.alpha"),
        (["--lora.dropout", "1"], "lora.dropout"),
        (["--lora.target_modules", "[]"], "lora.target_modules"),
    ],
)
def test_bad_lora_values_are_refused_in_one_line(override, says):
    with pytest.raises(ConfigError) as e:
        load_rl_config(overrides=override)
    assert says in str(e.value)


def test_a_vllm_engine_with_lora_on_a_config_built_gpt2_is_refused_in_one_line():
    # vLLM has no LoRA layers for gpt2: refused at config load, naming both ways out.
    with pytest.raises(ConfigError) as e:
        load_rl_config(overrides=["--engine.kind", "vllm", "--lora.r", "4"])
    said = str(e.value).split(": ", 1)[1]
    assert said.startswith('(top level): rl.lora with rl.engine.kind = "vllm" needs a model')
    assert 'rl.model.arch = "llama"' in said and 'rl.engine.kind = "hf"' in said
    # Either way out is accepted, and so is a saved model (vLLM judges it at start).
    for fix in (["--model.arch", "llama"], ["--engine.kind", "hf"], ["--model.path", "/m"]):
        over = ["--engine.kind", "vllm", "--lora.r", "4", *fix]
        assert load_rl_config(overrides=over).lora is not None


@pytest.mark.parametrize(
    ("arch", "names"),
    [("gpt2", "c_attn, c_proj, c_fc, lm_head"), ("llama", "q_proj, k_proj, v_proj, o_proj")],
)
def test_target_modules_that_match_nothing_are_named_with_the_models_own(arch, names):
    tok = task_tokenizer(TaskSection())
    model = build_model(ModelSection(arch=arch), tok)
    with pytest.raises(ValueError) as e:
        apply_lora(model, LoraSection(target_modules=["q_projx"]), 0)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith(
        f'rl.lora.target_modules ["q_projx"] match no module of the model ({arch})'
    )
    assert names in msg


def test_the_adapter_is_the_only_state_and_the_same_seed_gives_the_same_one():
    tok = task_tokenizer(TaskSection())
    spec, lora = ModelSection(), LoraSection(r=4, target_modules=["c_attn"])
    a = apply_lora(build_model(spec, tok), lora, 0)
    b = apply_lora(build_model(spec, tok), lora, 0)
    state = trainable_state(a)
    assert state and all("lora_" in k for k in state)
    assert sorted(k.replace(".default", "") for k in state) == sorted(adapter_state(a))
    # 2 layers x (A: 4 x 64, B: 192 x 4), fp32
    assert nbytes(adapter_state(a)) == 2 * (4 * 64 + 192 * 4) * 4
    for k, v in trainable_state(b).items():
        assert torch.equal(v, state[k])
    with torch.no_grad():
        for v in state.values():
            v.normal_()
    load_trainable(b, {k: v.clone() for k, v in state.items()})
    assert all(torch.equal(v, state[k]) for k, v in trainable_state(b).items())
    with pytest.raises(ValueError, match="trainable tensors must be this model's"):
        load_trainable(b, {"nope": torch.zeros(1)})


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_merged_adapter_computes_the_adapted_model(arch):
    tok = task_tokenizer(TaskSection())
    spec, lora = ModelSection(arch=arch), LoraSection(r=4)
    policy = apply_lora(build_model(spec, tok), lora, 0).eval()
    served = MergedAdapter(apply_lora(build_model(spec, tok), lora, 0))
    x = torch.tensor([[1, 2, 3, 4, 5]])
    for scale in (1.0, 0.5):  # two versions: the second merges onto W0, not onto the first
        with torch.no_grad():
            for p in policy.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn_like(p) * scale)
        served.load({k: v.clone() for k, v in adapter_state(policy).items()})
        want, got = policy(input_ids=x).logits, served.model(input_ids=x).logits
        assert torch.allclose(want, got, atol=1e-5), (want - got).abs().max()
    with pytest.raises(ValueError, match="every adapter tensor"):
        served.load(dict(list(adapter_state(policy).items())[:1]))


def test_phalanx_run_refuses_targets_that_match_nothing_before_anything_starts(tmp_path):
    # The RL demo with a LoRA aimed at a module gpt2 does not have: one line from the
    # launcher (the model is built on the meta device), and no run directory made.
    from phalanx import cli

    run_dir = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        cli.main(
            [
                "run",
                "examples/sort_grpo.toml",
                "--plain",
                "--run-dir",
                str(run_dir),
                "--rl.lora.r=4",
                '--rl.lora.target_modules=["q_projx"]',
            ]
        )
    msg = str(e.value.code)
    assert msg.startswith('phalanx run: rl.lora.target_modules ["q_projx"] match no module')
    assert "c_attn" in msg and "\n" not in msg, msg
    assert not run_dir.exists()

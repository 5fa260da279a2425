"""The policy step in bounded memory: micro-batching, bf16 autocast over fp32 masters,
activation checkpointing, peak memory."""

from __future__ import annotations

import random

import pytest
import torch

from phalanx.config.rl import GRPOSection, ModelSection
from phalanx.rl.engine.base import Completion
from phalanx.rl.grpo import collate, group_advantages, token_logprobs
from phalanx.rl.model import build_model, load_model
from phalanx.rl.step import backward_rows, micro_batches, peak_memory_mb, prepare
from phalanx.rl.tokenizer import CharTokenizer

TOK = CharTokenizer()
G = 4


pytestmark = pytest.mark.usefixtures("one_thread")


def _batch(model, n_prompts=3, seed=0):
    """``n_prompts`` groups of G completions of mixed lengths, behaviour log-probs slightly
    off the model's (ratios != 1, so the clip can act), and mixed rewards."""
    rng = random.Random(seed)
    comps = []
    for p in range(n_prompts):
        prompt = TOK.encode(
            "".join(rng.choice("0123456789") for _ in range(rng.randint(2, 5))) + ">"
        )
        for _ in range(G):
            toks = [3 + rng.randrange(10) for _ in range(rng.randint(1, 6))] + [TOK.eos_id]
            comps.append(Completion(p, prompt, toks, [0.0] * len(toks), True, 0))
    batch = collate(comps, [0.0] * len(comps), TOK.pad_id)
    with torch.no_grad():
        lp = token_logprobs(model, batch)
    for i, c in enumerate(comps):
        cols = batch.completion_mask[i].nonzero().squeeze(1)
        c.logprobs = (lp[i, cols] + 0.05 * rng.uniform(-1, 1)).tolist()
    rewards = torch.tensor([float(rng.random() < 0.5) for _ in comps])
    return comps, group_advantages(rewards, G)


def _grads(model, comps, adv, g, ref=None):
    model.zero_grad(set_to_none=True)
    n = sum(len(c.token_ids) for c in comps)
    stats = backward_rows(
        model, comps, adv, list(range(len(comps))), g=g, pad_id=TOK.pad_id, num_tokens=n, ref=ref
    )
    return [p.grad.clone() for p in model.parameters()], stats


@pytest.mark.parametrize("kl_coef", [0.0, 0.05])
def test_micro_batches_accumulate_to_the_unsplit_step(kl_coef):
    model = build_model(ModelSection(seed=3), TOK).train()
    ref = build_model(ModelSection(seed=4), TOK).eval().requires_grad_(False) if kl_coef else None
    comps, adv = _batch(model)
    whole, s_whole = _grads(model, comps, adv, GRPOSection(kl_coef=kl_coef), ref)
    assert any(g.abs().sum() > 0 for g in whole)
    for size in (1, 5):
        split, s_split = _grads(
            model, comps, adv, GRPOSection(kl_coef=kl_coef, micro_batch_size=size), ref
        )
        for a, b in zip(whole, split, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
        assert s_split["loss"] == pytest.approx(s_whole["loss"], rel=1e-5, abs=1e-7)
        for k in ("num_tokens", "train_tokens"):
            assert s_split[k] == s_whole[k]
        for k in ("ratio_mean", "clip_frac", "kl_behaviour", "entropy"):
            assert s_split[k] == pytest.approx(s_whole[k], rel=1e-5, abs=1e-7)
        if kl_coef:
            assert s_split["kl_ref"] == pytest.approx(s_whole["kl_ref"], rel=1e-5, abs=1e-7)
    assert s_whole["num_tokens"] == sum(len(c.token_ids) for c in comps)
    assert s_whole["train_tokens"] == sum(len(c.prompt_ids) + len(c.token_ids) for c in comps)
    assert 0 < s_whole["entropy"] < torch.log(torch.tensor(float(TOK.vocab_size))).item()


def test_micro_batches_cover_every_row_once():
    assert list(micro_batches([4, 7, 9, 1, 2], 2)) == [[4, 7], [9, 1], [2]]
    assert list(micro_batches([4, 7], 0)) == [[4, 7]]
    assert list(micro_batches([], 3)) == []


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_activation_checkpointing_gives_the_same_gradients(arch):
    plain = build_model(ModelSection(arch=arch, seed=5), TOK).train()
    ckpt = prepare(
        build_model(ModelSection(arch=arch, seed=5), TOK).train(),
        GRPOSection(activation_checkpointing=True),
    )
    assert ckpt.is_gradient_checkpointing
    comps, adv = _batch(plain)
    a, _ = _grads(plain, comps, adv, GRPOSection(micro_batch_size=4))
    b, _ = _grads(ckpt, comps, adv, GRPOSection(micro_batch_size=4, activation_checkpointing=True))
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


def test_bf16_computes_under_autocast_and_keeps_fp32_masters():
    model = build_model(ModelSection(seed=6), TOK).train()
    comps, adv = _batch(model)
    fp32, s32 = _grads(model, comps, adv, GRPOSection())
    bf16, s16 = _grads(model, comps, adv, GRPOSection(precision="bf16", micro_batch_size=6))
    # The masters and their gradients stay fp32; the step is close to the fp32 one.
    assert all(
        p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters()
    )
    num = sum(float((a - b).norm() ** 2) for a, b in zip(fp32, bf16, strict=True)) ** 0.5
    den = sum(float(a.norm() ** 2) for a in fp32) ** 0.5
    assert 0 < num / den < 0.1
    assert s16["loss"] == pytest.approx(s32["loss"], rel=0.05, abs=1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    states = [t for st in opt.state.values() for t in st.values() if t.numel() > 1]
    assert states and all(t.dtype == torch.float32 for t in states)


def test_a_bf16_checkpoint_loads_into_fp32_masters(tmp_path):
    model = build_model(ModelSection(arch="llama", seed=7), TOK)
    model.to(torch.bfloat16).save_pretrained(tmp_path / "m")
    loaded = load_model(tmp_path / "m")
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    first = next(iter(model.state_dict()))
    torch.testing.assert_close(loaded.state_dict()[first], model.state_dict()[first].float())


def test_peak_memory_is_reported_in_mib():
    before = peak_memory_mb(torch.device("cpu"))
    blob = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    after = peak_memory_mb(torch.device("cpu"))
    del blob
    assert 10 < before <= after
    assert after < 2**20  # MiB, not KiB or bytes

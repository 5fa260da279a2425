"""GRPO: group advantages, the clipped objective, token-level normalisation, the KL term."""

from __future__ import annotations

import pytest
import torch

from phalanx.config.rl import ModelSection
from phalanx.rl.engine.base import Completion
from phalanx.rl.grpo import (
    collate,
    group_advantages,
    grpo_loss,
    reference_logprobs,
    token_logprobs,
)
from phalanx.rl.model import build_model
from phalanx.rl.tokenizer import CharTokenizer

TOK = CharTokenizer()


pytestmark = pytest.mark.usefixtures("one_thread")


def test_advantages_are_group_normalised():
    r = torch.tensor([0.0, 1.0, 0.5, 0.5, 0.2, 0.2, 0.2, 0.2])
    a = group_advantages(r, group_size=4, eps=0.0)
    g0 = a[:4]
    assert g0.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert g0.std(correction=0).item() == pytest.approx(1.0, abs=1e-5)
    assert g0[1] > g0[2] == g0[3] > g0[0]


def test_zero_variance_group_gets_zero_advantages_not_nan():
    a = group_advantages(torch.tensor([0.2, 0.2, 0.2, 0.2, 1.0, 0.0, 1.0, 0.0]), 4)
    assert torch.isfinite(a).all()
    assert torch.equal(a[:4], torch.zeros(4))
    assert torch.equal(group_advantages(torch.tensor([1.0, 0.0]), 1), torch.zeros(2))


def test_advantages_reject_ragged_groups():
    with pytest.raises(ValueError, match="multiple of group_size"):
        group_advantages(torch.zeros(5), 4)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(ModelSection(seed=1), TOK)


def _completions(model, temperature=1.0, stale=0.0):
    """Completions of mixed lengths whose behaviour log-probs are the model's own (ratio 1),
    optionally shifted by ``stale`` to make ratios differ from 1."""
    rows = [
        ("3142>", [3 + 1, 3 + 2, 3 + 3, 3 + 4, TOK.eos_id]),
        ("90>", [3 + 0, TOK.eos_id]),
        ("5>", [3 + 5, 3 + 5, 3 + 5]),
    ]
    comps = [
        Completion(
            i, TOK.encode(p), toks, [0.0] * len(toks), finished=toks[-1] == TOK.eos_id, version=0
        )
        for i, (p, toks) in enumerate(rows)
    ]
    batch = collate(comps, [0.0] * len(comps), TOK.pad_id)
    with torch.no_grad():
        lp = token_logprobs(model, batch, temperature)
    for i, c in enumerate(comps):
        cols = batch.completion_mask[i].nonzero().squeeze(1)
        c.logprobs = (lp[i, cols] + stale * (i + 1)).tolist()
    return comps


def test_collate_aligns_targets_with_completion_tokens(model):
    comps = _completions(model)
    batch = collate(comps, [1.0, 2.0, 3.0], TOK.pad_id)
    assert batch.input_ids.shape == (3, 11)
    assert batch.num_tokens == 5 + 2 + 3
    for i, c in enumerate(comps):
        cols = batch.completion_mask[i].nonzero().squeeze(1)
        assert batch.input_ids[i, cols + 1].tolist() == c.token_ids
        assert batch.old_logprobs[i, cols].tolist() == pytest.approx(c.logprobs)


def test_clipped_objective_equals_policy_gradient_at_ratio_one(model):
    comps = _completions(model)
    adv = [1.5, -0.5, -1.0]
    batch = collate(comps, adv, TOK.pad_id)
    loss, stats = grpo_loss(model, batch, clip_eps=0.2)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert stats["clip_frac"] == 0.0
    grads = torch.autograd.grad(loss, list(model.parameters()))

    # REINFORCE with the same token-level normaliser: -sum(A * logp) / N.
    logp = token_logprobs(model, batch)
    pg = -(batch.advantages[:, None] * logp * batch.completion_mask).sum() / batch.num_tokens
    pg_grads = torch.autograd.grad(pg, list(model.parameters()))
    expected_value = -(batch.advantages[:, None] * batch.completion_mask).sum() / batch.num_tokens
    assert loss.item() == pytest.approx(expected_value.item(), abs=1e-6)
    for g, h in zip(grads, pg_grads, strict=True):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-7)


def test_token_level_normalisation(model):
    comps = _completions(model)
    batch = collate(comps, [1.0, 1.0, 1.0], TOK.pad_id)
    local, _ = grpo_loss(model, batch)
    # At ratio 1 with A = 1 each token contributes -1: the mean over all 10 tokens,
    # not the mean over 3 sequences of per-sequence means.
    assert local.item() == pytest.approx(-1.0, abs=1e-6)
    global_, _ = grpo_loss(model, batch, num_tokens=40)
    assert global_.item() == pytest.approx(-10 / 40, abs=1e-6)
    # Splitting the batch and passing the global count sums to the whole-batch loss.
    parts = [grpo_loss(model, collate([c], [1.0], TOK.pad_id), num_tokens=10)[0] for c in comps]
    assert sum(p.item() for p in parts) == pytest.approx(local.item(), abs=1e-6)


def test_clip_stops_gradient_beyond_the_band(model):
    comps = _completions(model, stale=-1.0)  # old log-probs lower: ratios e, e^2, e^3 > 1.2
    batch = collate(comps, [1.0, 1.0, 1.0], TOK.pad_id)
    loss, stats = grpo_loss(model, batch, clip_eps=0.2)
    assert stats["clip_frac"] == 1.0
    assert stats["ratio_mean"] > 1.2
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    assert all(g is None or torch.count_nonzero(g) == 0 for g in grads)
    # A negative advantage is not clipped on the upper side: the gradient flows.
    batch = collate(comps, [-1.0, -1.0, -1.0], TOK.pad_id)
    loss, stats = grpo_loss(model, batch, clip_eps=0.2)
    assert stats["clip_frac"] == 0.0
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())
    model.zero_grad(set_to_none=True)


def test_temperature_is_applied_consistently(model):
    comps = _completions(model, temperature=0.5)
    batch = collate(comps, [1.0, -1.0, 0.5], TOK.pad_id)
    _, stats = grpo_loss(model, batch, temperature=0.5)
    assert stats["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    _, stats = grpo_loss(model, batch, temperature=1.0)
    assert abs(stats["ratio_mean"] - 1.0) > 1e-3


def test_kl_term(model):
    comps = _completions(model)
    batch = collate(comps, [1.0, -1.0, 0.5], TOK.pad_id)
    with pytest.raises(ValueError, match="ref_logprobs must be given when kl_coef > 0"):
        grpo_loss(model, batch, kl_coef=0.1)
    ref = reference_logprobs(model, batch)
    plain, _ = grpo_loss(model, batch)
    with_kl, stats = grpo_loss(model, batch, kl_coef=0.1, ref_logprobs=ref)
    assert stats["kl_ref"] == pytest.approx(0.0, abs=1e-7)
    assert with_kl.item() == pytest.approx(plain.item(), abs=1e-7)
    _, stats = grpo_loss(model, batch, kl_coef=0.1, ref_logprobs=ref - 0.3)
    assert stats["kl_ref"] > 0.01


def test_constant_groups_get_exactly_zero_advantages():
    # 16 x 0.2 does not sum to exactly 3.2 in float32: the mean is off by an ulp.
    r = torch.cat([torch.full((16,), 0.2), torch.full((16,), 0.6), torch.rand(16)])
    a = group_advantages(r, 16)
    assert torch.equal(a[:32], torch.zeros(32))
    assert torch.count_nonzero(a[32:]) == 16


def test_dropping_zero_advantage_rows_keeps_the_gradient(model):
    """Rows with A = 0 contribute nothing; with the full token count as the
    normaliser, the gradient of the remaining rows equals the whole batch's."""
    comps = _completions(model, stale=0.1)  # ratios != 1, so the clip is in play
    adv = [1.5, 0.0, -1.0]
    full = collate(comps, adv, TOK.pad_id)
    loss, _ = grpo_loss(model, full)
    want = torch.autograd.grad(loss, list(model.parameters()))
    part = collate([comps[0], comps[2]], [adv[0], adv[2]], TOK.pad_id)
    loss, _ = grpo_loss(model, part, num_tokens=full.num_tokens)
    got = torch.autograd.grad(loss, list(model.parameters()))
    for g, h in zip(got, want, strict=True):
        torch.testing.assert_close(g, h, rtol=1e-5, atol=1e-7)

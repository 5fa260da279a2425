"""GRPO: group-normalised advantages and the clipped, token-normalised policy loss.

Group Relative Policy Optimization (Shao et al. 2024, "DeepSeekMath",
arXiv:2402.03300). For each prompt q, G completions o_1..o_G are sampled from
the behaviour policy mu (the engine's weights at the sampling temperature) and
scored r_1..r_G. Every token of o_i gets the advantage

    A_i = (r_i - mean(r)) / (std(r) + eps)

(std over the group, population form), and the loss is the PPO clipped
surrogate (Schulman et al. 2017) with ratio rho_t = pi_theta(o_t | q, o_<t) / mu(o_t | ...):

    L = -1/N * sum_i sum_t [ min(rho_t A_i, clip(rho_t, 1 - eps_lo, 1 + eps_hi) A_i)
                             - beta * KL_t(pi_theta || pi_ref) ]

where KL_t is the k3 estimator exp(ref_t - logp_t) - (ref_t - logp_t) - 1 and
N is the number of completion tokens in the batch: token-level normalisation
(as in DAPO, Yu et al. 2025, arXiv:2503.14476), so every token weighs the same
whatever the length of its completion. Under data parallelism each replica sums
over its own tokens and divides by the GLOBAL N (``num_tokens``); the
all-reduced (summed) gradients then equal the single-process gradient of the
whole batch. Off-policy corrections of the surrogate (decoupled PPO, TIS, MIS)
are in :mod:`phalanx.rl.corrections`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.config.rl import GRPOSection
from phalanx.rl.corrections import surrogate
from phalanx.rl.engine.base import Completion


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """``(r - mean) / (std + eps)`` within consecutive groups of ``group_size``.

    ``rewards`` is flat and prompt-major (as ``GenerationEngine.generate``
    returns completions). A group whose rewards are all equal carries no
    signal and gets exactly zero advantages (never NaN), as does a group of one.
    """
    if rewards.ndim != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards must be a flat tensor whose length is a multiple of group_size: got "
            f"shape {tuple(rewards.shape)}, group_size={group_size}. Pass all G completions "
            f"of every prompt, prompt-major."
        )
    r = rewards.float().view(-1, group_size)
    centred = r - r.mean(dim=1, keepdim=True)
    std = r.std(dim=1, keepdim=True, correction=0)
    adv = centred / (std + eps)
    # Summation rounding can leave a constant group with a mean 1 ulp off its
    # values; make its advantages exactly 0 so callers may drop those rows.
    flat = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    return adv.masked_fill(flat, 0.0).view(-1)


@dataclass
class RolloutBatch:
    """A padded training batch of prompt + completion sequences (right-padded).

    Per-token tensors are aligned with the *targets*: column ``t`` scores
    ``input_ids[:, t + 1]`` given ``input_ids[:, : t + 1]``; ``completion_mask``
    is 1 exactly where that target is a completion token (EOS included).
    """

    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    completion_mask: torch.Tensor  # [B, L - 1], float
    old_logprobs: torch.Tensor  # [B, L - 1], behaviour log-probs, 0 off the mask
    advantages: torch.Tensor  # [B]

    @property
    def num_tokens(self) -> int:
        return int(self.completion_mask.sum().item())


def collate(
    completions: Sequence[Completion],
    advantages: Sequence[float] | torch.Tensor,
    pad_id: int,
    device: str | torch.device = "cpu",
) -> RolloutBatch:
    """Pack completions (prompt ids, completion ids, behaviour log-probs) and advantages."""
    if len(completions) != len(advantages) or not completions:
        raise ValueError(
            f"completions and advantages must be non-empty and of equal length: got "
            f"{len(completions)} and {len(advantages)}."
        )
    width = max(len(c.prompt_ids) + len(c.token_ids) for c in completions)
    b = len(completions)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    cmask = torch.zeros((b, width - 1))
    old = torch.zeros((b, width - 1))
    for i, c in enumerate(completions):
        if len(c.logprobs) != len(c.token_ids):
            raise ValueError(
                f"completion {i} must have one behaviour log-prob per token: got "
                f"{len(c.logprobs)} log-probs for {len(c.token_ids)} tokens."
            )
        p, n = len(c.prompt_ids), len(c.token_ids)
        ids[i, : p + n] = torch.tensor(list(c.prompt_ids) + list(c.token_ids))
        attn[i, : p + n] = 1
        # Target column t predicts token t + 1: completion token k sits at p + k. An
        # episode's environment tokens (mask 0) are context, not trained on.
        cmask[i, p - 1 : p - 1 + n] = torch.tensor(c.mask, dtype=cmask.dtype) if c.mask else 1
        old[i, p - 1 : p - 1 + n] = torch.tensor(c.logprobs)
    adv = torch.as_tensor(advantages, dtype=torch.float32)
    return RolloutBatch(
        ids.to(device), attn.to(device), cmask.to(device), old.to(device), adv.to(device)
    )


def token_logprobs(model: Any, batch: RolloutBatch, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / T)`` of every target token, ``[B, L - 1]``, one padded forward."""
    return _forward(model, batch, temperature, entropy=False)[0]


def _forward(
    model: Any, batch: RolloutBatch, temperature: float, entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Target-token log-probs and, with ``entropy``, the per-position entropy of the
    tempered distribution (no gradient: it is a metric, not a loss term)."""
    pos = torch.arange(batch.input_ids.shape[1], device=batch.input_ids.device)
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=pos.expand_as(batch.input_ids),
        use_cache=False,
    )
    logits = out.logits[:, :-1, :].float()
    if temperature != 1.0:
        logits = logits / temperature
    targets = batch.input_ids[:, 1:, None]
    lse = torch.logsumexp(logits, dim=-1)
    ent = None
    if entropy:
        with torch.no_grad():
            # H = logsumexp(z) - sum softmax(z) * z
            ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return logits.gather(-1, targets).squeeze(-1) - lse, ent


def grpo_loss(
    model: Any,
    batch: RolloutBatch,
    *,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    temperature: float = 1.0,
    num_tokens: float | None = None,
    kl_coef: float = 0.0,
    ref_logprobs: torch.Tensor | None = None,
    correction: str = "none",
    is_cap: float = 2.0,
    prox_logprobs: torch.Tensor | None = None,
    keep_logprobs: list[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The GRPO loss of ``batch`` under ``model`` (see the module docstring), and stats.

    ``temperature`` must be the one the engine sampled at, so that the ratio
    compares the same distributions. ``num_tokens`` is the normaliser N; None
    uses this batch's completion-token count, a distributed caller passes the
    global count over all replicas and micro-batches. ``ref_logprobs``
    (``reference_logprobs`` of the reference model) is required iff
    ``kl_coef > 0``. ``correction`` and ``is_cap`` pick the off-policy correction of the
    surrogate (:mod:`phalanx.rl.corrections`; "none" is the formula above), and
    ``prox_logprobs`` (aligned as ``old_logprobs``, NaN where unknown) its proximal
    policy; ``keep_logprobs``, when given, gets this forward's detached log-probs
    appended (a caller records them as the batch's proximal policy). Call
    ``.backward()`` on the returned loss.
    """
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(
            f"ref_logprobs must be given when kl_coef > 0: got kl_coef={kl_coef} and none. "
            f"Compute them with reference_logprobs(ref_model, batch), or set kl_coef=0."
        )
    mask = batch.completion_mask
    n = float(num_tokens) if num_tokens is not None else max(float(mask.sum().item()), 1.0)
    logp, ent = _forward(model, batch, temperature, entropy=True)
    if keep_logprobs is not None:
        keep_logprobs.append(logp.detach())
    per_token, corr = surrogate(
        logp,
        batch.old_logprobs,
        batch.advantages,
        mask,
        correction=correction,
        clip_eps=clip_eps,
        clip_eps_high=clip_eps_high,
        is_cap=is_cap,
        prox=prox_logprobs,
    )
    kl = None
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError(
                f"ref_logprobs must be given when kl_coef > 0: got kl_coef={kl_coef} and no "
                "reference log-probs. Pass reference_logprobs(ref_model, batch), or kl_coef=0."
            )
        d = (ref_logprobs - logp) * mask
        kl = torch.exp(d) - d - 1
        per_token = per_token + kl_coef * kl
    loss = (per_token * mask).sum() / n
    with torch.no_grad():
        local = max(float(mask.sum().item()), 1.0)
        # pi_theta / mu in value, whatever the correction.
        log_ratio = (logp - batch.old_logprobs) * mask
        ratio = torch.exp(log_ratio)
        stats = {
            "loss": float(loss.item()),
            "num_tokens": float(mask.sum().item()),
            "ratio_mean": float((ratio * mask).sum().item() / local),
            "ratio_max": float(ratio.masked_fill(mask == 0, 1.0).max().item()),
            # k3 estimate of KL(mu || pi_theta): 0 on the first step after a sync.
            "kl_behaviour": float(((ratio - 1 - log_ratio) * mask).sum().item() / local),
            "entropy": float(((ent if ent is not None else 0.0) * mask).sum().item() / local),
            **corr,
        }
        if kl is not None:
            stats["kl_ref"] = float((kl * mask).sum().item() / local)
    return loss, stats


@torch.no_grad()
def reference_logprobs(
    ref_model: Any, batch: RolloutBatch, temperature: float = 1.0
) -> torch.Tensor:
    """Per-token log-probs of ``batch`` under the frozen reference model (for the KL term)."""
    return token_logprobs(ref_model, batch, temperature)


def lr_lambda(g: GRPOSection, total_steps: int) -> Callable[[int], float]:
    """Multiplier of ``g.lr`` at optimizer step ``i``: linear warmup, then constant or cosine."""

    def f(i: int) -> float:
        if i < g.warmup_steps:
            return (i + 1) / g.warmup_steps
        if g.lr_decay == "constant":
            return 1.0
        frac = min(1.0, (i - g.warmup_steps) / max(1, total_steps - g.warmup_steps))
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac))

    return f


def rows_to_train(adv: torch.Tensor, kl_coef: float) -> list[int]:
    """Rows whose loss can have a non-zero gradient.

    A zero advantage makes every term of the clipped surrogate zero whatever
    the ratio, so without a KL term such rows (whole groups with equal
    rewards, e.g. solved prompts) only cost a forward and backward. Dropping
    them while keeping the batch's full token count as the normaliser leaves
    the gradient unchanged. One row is always kept so that the optimizer still
    steps (AdamW's moments decay on a zero gradient exactly as without the drop).
    """
    if kl_coef > 0:
        return list(range(len(adv)))
    keep = adv.nonzero().squeeze(1).tolist()
    return keep or [0]

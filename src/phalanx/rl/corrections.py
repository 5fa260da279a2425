"""Off-policy corrections of the GRPO surrogate, and the off-policy metrics of a step.

A rollout trained asynchronously was sampled by a behaviour policy mu (the engine's
weights, up to ``rl.loop.max_staleness`` versions old, and a different numerical
stack) that is not the trainer's pi_theta. Symbols, per completion token t of row i:

- ``logp``: log pi_theta (with gradient);
- pi_prox: the *proximal* policy, the trainer's log-probs at the start of the
  batch's training (its first optimizer step, before any update on it), as AReaL
  recomputes them before a train step's minibatches. The first of the batch's
  ``grpo.inner_epochs`` steps takes them from its own forward (``logp.detach()``);
  the later steps get them back (``prox``), so r_t = pi_theta/pi_prox departs from 1
  there and the clip bounds how far the batch moves the policy. A row with no
  recorded pi_prox (its replica joined, or took over the row, mid-batch) uses the
  step's own forward: its clip is inactive for that step;
- ``old``: log mu, the behaviour log-probs the engine recorded;
- d_t = log pi_prox - log mu, and the importance weight w_t = exp(d_t) = pi_prox/mu;
- A_i the group advantage, eps_lo / eps_hi the clip band, C = ``rl.grpo.is_cap`` > 1,
  N the normaliser (the batch's completion tokens).

``grpo.correction`` picks the per-token loss ``l_t`` (the loss is sum_t l_t / N):

- **none**: today's PPO surrogate (Schulman et al. 2017) against mu, clip against mu:
  rho_t = pi_theta/mu, l_t = -min(rho_t A, clip(rho_t, 1-eps_lo, 1+eps_hi) A).
- **decoupled**: decoupled PPO (Hilton et al. 2021, "Batch size-invariance for
  policy optimization", arXiv:2110.00137; AReaL, Fu et al. 2025, arXiv:2505.24298).
  The clip is against pi_prox, r_t = pi_theta/pi_prox, and each token is weighted by
  the behaviour weight w_t; a token whose weight exceeds C is dropped (weight 0), as
  AReaL's ``behav_imp_weight_cap`` does (it masks, it does not truncate):
  l_t = -1[w_t <= C] w_t * min(r_t A, clip(r_t, 1-eps_lo, 1+eps_hi) A).
  On the batch's first step r_t is 1 in value at the forward (pi_prox is that
  step's weights), the clip is inactive and the gradient is the w-weighted policy
  gradient over the tokens under the cap; on the later inner epochs the clip acts.
- **tis_token**: truncated importance sampling (Yao et al. 2025, "Your Efficient RL
  Framework Secretly Brings You Off-Policy RL Training", fengyao.notion.site;
  truncation as in IMPALA, Espeholt et al. 2018, arXiv:1802.01561): the PPO-clipped
  loss against pi_prox times min(w_t, C). It differs from ``decoupled`` only above
  the cap: TIS keeps such a token at weight C, decoupled PPO drops it.
- **tis_sequence**: the same with one weight per completion,
  w_i = min(exp(sum_t d_t), C), applied to every token of row i.
- **mis_token**: masked importance sampling (the ``mask`` mode of verl's rollout
  importance sampling; IcePop): a token whose w_t lies outside [1/C, C] is dropped
  from the loss; a kept token is weighted by w_t (as verl and IcePop keep it):
  l_t = -1[1/C <= w_t <= C] w_t min(r_t A, clip(r_t) A).
- **mis_sequence**: the same per completion, with the geometric-mean ratio
  g_i = exp(mean_t d_t) (verl's ``geometric`` level): the plain product exp(sum d)
  grows with the completion's length, so a long completion would be masked for a
  per-token mismatch that a short one passes. Row i is kept iff 1/C <= g_i <= C,
  and its tokens are weighted by g_i.

Masked tokens still count in N: dropping them must not scale up the gradient of
the tokens that are kept (a step with many masked tokens is a smaller step, not a
noisier one).

Metrics (per micro-batch, merged by :func:`phalanx.rl.step.merge_stats`):

- ``mismatch_kl``: the k3 estimate (Schulman 2020, "Approximating KL divergence")
  of KL(mu || pi_prox) per token, mean_t(exp(d_t) - d_t - 1): unbiased under
  sampling from mu, which is how the tokens came. It is ``kl_behaviour`` taken at
  pi_prox, which at the forward is the same value;
- ``ess``: effective sample size fraction of the weights w over the share's tokens,
  (sum w)^2 / (N sum w^2) in (0, 1] (Kong 1992); 1 when mu = pi_prox. The sums
  ``is_w_sum`` and ``is_w_sq_sum`` travel with it so a merge is exact;
- ``is_clip_frac``: fraction of tokens whose weight was truncated (TIS);
- ``is_mask_frac``: fraction of tokens masked out (MIS, and decoupled's tokens over
  the cap).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import torch

from phalanx.config.rl import CORRECTIONS


def surrogate(
    logp: torch.Tensor,
    old: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    *,
    correction: str = "none",
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    is_cap: float = 2.0,
    prox: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The per-token policy loss l_t ``[B, T]`` of ``correction`` (module docstring),
    not yet masked nor normalised, and its stats over the ``mask``ed tokens.

    ``prox``: log pi_prox ``[B, T]`` recorded on the batch's first step, NaN where a
    row has none (that row uses this step's ``logp.detach()``); None: this step's
    forward for every row (the batch's first step). Ignored by ``none``.

    ``logp`` carries the gradient; ``old`` holds log mu (0 off the mask); ``adv`` is
    ``[B]``; ``mask`` is 1 on completion tokens. The stats are ``clip_frac`` (the
    PPO clip acted), ``mismatch_kl``, ``ess``, ``is_w_sum``, ``is_w_sq_sum``,
    ``is_clip_frac`` and ``is_mask_frac``.
    """
    if correction not in CORRECTIONS:
        raise ValueError(
            f"rl.grpo.correction must be one of {', '.join(CORRECTIONS)}: got "
            f"{correction!r}. Pick one of those (none: no correction)."
        )
    if is_cap <= 1:
        raise ValueError(
            f"rl.grpo.is_cap must be > 1: got {is_cap}. It caps the importance weight pi/mu; "
            f"2 is usual."
        )
    a = adv[:, None]
    hi = clip_eps if clip_eps_high is None else clip_eps_high
    # Off-mask columns have old = 0 and arbitrary logp: zero the log-ratio there
    # so exp() cannot overflow into inf * 0 = NaN.
    p = logp.detach() if prox is None else torch.where(prox.isnan(), logp.detach(), prox)
    d = (p - old) * mask
    if correction == "none":
        # Today's computation, operation for operation (bit-for-bit the old loss).
        ratio = torch.exp((logp - old) * mask)
        per_token = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip_eps, 1 + hi) * a)
        clipped_w = masked = torch.zeros_like(mask, dtype=torch.bool)
    else:
        ratio = torch.exp((logp - p) * mask)  # r_t = pi_theta / pi_prox, gradient of logp
        surr = torch.minimum(ratio * a, torch.clamp(ratio, 1 - clip_eps, 1 + hi) * a)
        weight, clipped_w, masked = _weights(d, mask, correction, is_cap)
        per_token = -weight * surr
    with torch.no_grad():
        stats = _stats(d, mask, ratio, a, clip_eps, hi, clipped_w, masked)
    return per_token, stats


def _weights(
    d: torch.Tensor, mask: torch.Tensor, correction: str, cap: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The detached weight of every token, which tokens had their weight truncated,
    and which were masked out (all ``[B, T]``)."""
    log_cap = math.log(cap)
    on = mask > 0
    none = torch.zeros_like(on)
    if correction == "decoupled":
        # AReaL: a token over the cap leaves the loss (clamped first: never inf * 0).
        over = d > log_cap
        return torch.exp(d.clamp(max=log_cap)) * ~over, none, over & on
    if correction == "tis_token":
        # exp(min(d, log C)) = min(w, C), and never inf for a large d.
        return torch.exp(d.clamp(max=log_cap)), (d > log_cap) & on, none
    if correction == "tis_sequence":
        s = d.sum(dim=1, keepdim=True)
        w = torch.exp(s.clamp(max=log_cap)).expand_as(d)
        return w, (s > log_cap).expand_as(d) & on, none
    if correction == "mis_token":
        keep = (d >= -log_cap) & (d <= log_cap)
        return torch.exp(d) * keep, none, ~keep & on
    # mis_sequence: the geometric mean of the row's ratios.
    g = d.sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    keep = ((g >= -log_cap) & (g <= log_cap)).expand_as(d)
    return torch.exp(g).expand_as(d) * keep, none, ~keep & on


def _stats(
    d: torch.Tensor,
    mask: torch.Tensor,
    ratio: torch.Tensor,
    a: torch.Tensor,
    lo_eps: float,
    hi_eps: float,
    clipped_w: torch.Tensor,
    masked: torch.Tensor,
) -> dict[str, float]:
    local = max(float(mask.sum().item()), 1.0)
    clipped = ((ratio < 1 - lo_eps) & (a < 0)) | ((ratio > 1 + hi_eps) & (a > 0))
    # float64: w^2 of a token the engine found unlikely overflows float32 long before
    # the ESS stops meaning something.
    w = torch.exp(d.double()) * mask.double()
    w_sum, w_sq = float(w.sum().item()), float((w * w).sum().item())
    return {
        "clip_frac": float((clipped.float() * mask).sum().item() / local),
        "mismatch_kl": float(((torch.exp(d) - d - 1) * mask).sum().item() / local),
        "is_w_sum": w_sum,
        "is_w_sq_sum": w_sq,
        "ess": ess(w_sum, w_sq, float(mask.sum().item())),
        "is_clip_frac": float(clipped_w.sum().item() / local),
        "is_mask_frac": float(masked.sum().item() / local),
    }


def ess(w_sum: float, w_sq_sum: float, n: float) -> float:
    """Effective sample size fraction (sum w)^2 / (n sum w^2) in (0, 1]; 1 for no tokens."""
    if n <= 0 or w_sq_sum <= 0:
        return 1.0
    return min(1.0, w_sum * w_sum / (n * w_sq_sum))


class _Tokens(Protocol):
    @property
    def token_ids(self) -> Sequence[int]: ...


def staleness_histogram(comps: Iterable[tuple[int, _Tokens]], step: int) -> dict[int, int]:
    """Completion tokens per staleness ``step - v``, over (rollout version, completion)
    pairs; ``step`` is the version of the weights the optimizer step starts from.

    v is the token's own behaviour version where the completion has a non-empty
    ``versions`` (one per token: a weight update landed during generation), else
    the rollout's version. A multi-turn episode's environment tokens (``mask`` 0)
    are not trained on and not counted."""
    hist: Counter[int] = Counter()
    for version, c in comps:
        per_token: Any = getattr(c, "versions", None)
        mask: Any = getattr(c, "mask", None) or [1] * len(c.token_ids)
        if per_token:
            hist.update(step - int(v) for v, m in zip(per_token, mask, strict=True) if m)
        else:
            hist[step - version] += sum(mask)
    return dict(sorted(hist.items()))

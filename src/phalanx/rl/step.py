"""The policy's forward and backward over a set of rows, in bounded memory.

Shared by the policy replicas (:class:`phalanx.rl.trainer.PolicyTrainer`) and
the single-process baseline: both take one GRPO step the same way.

- **Micro-batching.** Rows go through the model ``grpo.micro_batch_size`` at a
  time and their gradients accumulate. Each micro-batch's loss is normalised
  by the whole batch's token count N (the GRPO loss is a sum over tokens
  divided by N), so the accumulated gradient is the un-split step's, up to
  float rounding; only the peak of activation memory changes.
- **bf16.** ``grpo.precision = "bf16"`` runs the forward (and so the backward)
  under autocast; the parameters, their gradients and the optimizer's moments
  stay fp32 (master weights), and the log-probs are taken in fp32.
- **Activation checkpointing** (``grpo.activation_checkpointing``): HF's
  gradient checkpointing, non-reentrant.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from phalanx.config.rl import GRPOSection
from phalanx.rl.corrections import ess
from phalanx.rl.engine.base import Completion
from phalanx.rl.grpo import RolloutBatch, collate, grpo_loss, reference_logprobs
from phalanx.rl.model import checkpoint_activations
from phalanx.train.perf import PEAK_TFLOPS, mfu, peak_memory_mb, peak_tflops

__all__ = [
    "PEAK_TFLOPS",
    "Proximal",
    "backward_rows",
    "merge_stats",
    "mfu",
    "peak_memory_mb",
    "peak_tflops",
]

_WEIGHTED = (
    "ratio_mean",
    "clip_frac",
    "kl_behaviour",
    "entropy",
    "kl_ref",
    "mismatch_kl",
    "is_clip_frac",
    "is_mask_frac",
)
"""Stats that are per-token means of a micro-batch: merged weighted by its tokens."""


def prepare(model: Any, g: GRPOSection) -> Any:
    """Set the training options of ``g`` on a freshly built policy ``model``; returns it."""
    if g.activation_checkpointing:
        checkpoint_activations(model, "grpo.activation_checkpointing")
    return model


def autocast(g: GRPOSection, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The compute-dtype context of ``g.precision`` on ``device`` (a no-op for fp32)."""
    if g.precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def micro_batches(rows: Sequence[int], size: int) -> Iterator[list[int]]:
    """``rows`` in consecutive chunks of ``size`` (0: one chunk)."""
    step = size if size > 0 else max(len(rows), 1)
    for i in range(0, len(rows), step):
        yield list(rows[i : i + step])


def backward_rows(
    model: Any,
    comps: Sequence[Completion],
    adv: torch.Tensor,
    rows: Sequence[int],
    *,
    g: GRPOSection,
    pad_id: int,
    num_tokens: int,
    ref: Any = None,
    passes: int = 0,
    filler: int | None = None,
    proximal: Proximal | None = None,
) -> dict[str, float]:
    """Forward and backward of ``comps[rows]`` with advantages ``adv[rows]``, micro-batched.

    ``passes``: run at least this many micro-batches, the extra ones on row
    ``filler`` with the loss times zero. The ranks of a sharded replica must run
    as many forwards and backwards as each other (FSDP's all-gathers and
    reduce-scatters pair up), whatever their share of the rows.

    ``num_tokens`` is the normaliser N: the completion tokens of the whole batch
    (over every replica of the quorum). Gradients accumulate into ``.grad``: the
    caller zeroes them before and steps after. Returns the merged stats of
    :func:`grpo_loss` (``loss`` is this call's share of the batch loss), plus
    ``train_tokens``, the non-pad tokens the model read (prompt and completion).

    ``proximal``: the batch's proximal policy (:class:`Proximal`), for an off-policy
    correction: rows it holds are trained against it, the others get this step's
    forward recorded as theirs. Pass the same one to every inner epoch of a batch.
    """
    device = next(model.parameters()).device
    if g.correction == "none":
        proximal = None  # the loss against mu needs no proximal policy
    parts: list[dict[str, float]] = []
    chunks: list[list[int] | None] = list(micro_batches(rows, g.micro_batch_size))
    fill = max(0, passes - len(chunks))
    if fill and filler is None:
        raise ValueError("backward_rows: extra passes need a filler row")
    for chunk in [*chunks, *([None] * fill)]:
        # A filler pass: the same collectives as a real micro-batch, and no
        # gradient (the loss times zero), for a rank with fewer rows.
        real = chunk is not None
        picked = chunk if chunk is not None else [int(filler or 0)]
        batch = collate([comps[i] for i in picked], adv[picked], pad_id, device)
        prox = proximal.tensor(comps, picked, batch) if proximal is not None else None
        keep: list[torch.Tensor] | None = [] if proximal is not None and real else None
        with autocast(g, device):
            ref_lp = reference_logprobs(ref, batch, g.temperature) if ref is not None else None
            loss, stats = grpo_loss(
                model,
                batch,
                clip_eps=g.clip_eps,
                clip_eps_high=g.clip_eps_high,
                temperature=g.temperature,
                num_tokens=num_tokens,
                kl_coef=g.kl_coef,
                ref_logprobs=ref_lp,
                correction=g.correction,
                is_cap=g.is_cap,
                prox_logprobs=prox,
                keep_logprobs=keep,
            )
        if proximal is not None and keep:
            proximal.record(comps, picked, keep[0])
        (loss if real else loss * 0.0).backward()
        if real:
            parts.append({**stats, "train_tokens": float(batch.attention_mask.sum().item())})
    return merge_stats(parts, with_ref=ref is not None)


class Proximal:
    """The proximal policy pi_prox of one batch (:mod:`phalanx.rl.corrections`): the
    log-probs of each of its rows' completion tokens under the weights its first
    optimizer step started from, recorded by that step and given back on the batch's
    later inner epochs, so that their clip bounds how far the batch moves the policy.

    Held by whoever trains the rows (a policy replica, the single-process loop), for
    one batch at a time: :meth:`start` with the batch index forgets another batch's.
    A row is keyed by its index in the batch's completions and checked against its
    tokens: a batch frozen anew (a payload was lost) may put another completion at
    an index, which then counts as unrecorded. A row this holder has no record of
    (it joined mid-batch, or a new quorum gave it rows another replica recorded)
    takes the step's own forward as its pi_prox: for that step its clip is inactive,
    as on a batch's first step.
    """

    def __init__(self) -> None:
        self.batch: int | None = None
        self.rows: dict[int, tuple[tuple[int, ...], torch.Tensor]] = {}

    def start(self, batch: int) -> None:
        """The rows trained next belong to ``batch``: a new batch starts unrecorded."""
        if batch != self.batch:
            self.batch, self.rows = batch, {}

    def forget(self) -> None:
        """Drop every record (the weights were replaced: a heal, a rollback)."""
        self.rows = {}

    @staticmethod
    def _key(c: Completion) -> tuple[int, ...]:
        return (*c.prompt_ids, -1, *c.token_ids)

    def tensor(
        self, comps: Sequence[Completion], picked: Sequence[int], batch: RolloutBatch
    ) -> torch.Tensor | None:
        """log pi_prox of ``comps[picked]`` aligned as ``batch.old_logprobs`` (as
        :func:`phalanx.rl.grpo.collate` lays the rows out), NaN where unrecorded; None
        when no row is recorded."""
        found: list[tuple[int, torch.Tensor]] = []
        for j, i in enumerate(picked):
            rec = self.rows.get(i)
            if rec is not None and rec[0] == self._key(comps[i]):
                found.append((j, rec[1]))
        if not found:
            return None
        out = torch.full_like(batch.old_logprobs, float("nan"))
        for j, lp in found:
            p = len(comps[picked[j]].prompt_ids)
            out[j, p - 1 : p - 1 + lp.numel()] = lp
        return out

    def record(
        self, comps: Sequence[Completion], picked: Sequence[int], logp: torch.Tensor
    ) -> None:
        """Keep ``logp`` (a forward's detached ``[B, L - 1]`` log-probs of
        ``comps[picked]``) as the pi_prox of the rows not recorded yet."""
        for j, i in enumerate(picked):
            c = comps[i]
            if i in self.rows and self.rows[i][0] == self._key(c):
                continue
            p, n = len(c.prompt_ids), len(c.token_ids)
            self.rows[i] = (self._key(c), logp[j, p - 1 : p - 1 + n].float().clone())


def merge_stats(parts: Sequence[dict[str, float]], *, with_ref: bool) -> dict[str, float]:
    """The stats of several passes as one: the sums (``loss``, ``num_tokens``,
    ``train_tokens``, ``is_w_sum``, ``is_w_sq_sum``), the largest ``ratio_max``, the
    per-token means weighted by each pass's tokens (``kl_ref`` only ``with_ref``), and
    ``ess`` from the merged sums, so it is the whole share's ESS exactly."""
    out: dict[str, float] = {"loss": 0.0, "num_tokens": 0.0, "ratio_max": 0.0, "train_tokens": 0.0}
    sums = dict.fromkeys(_WEIGHTED, 0.0)
    w_sum = w_sq = 0.0
    for stats in parts:
        n = stats["num_tokens"]
        out["loss"] += stats["loss"]
        out["num_tokens"] += n
        out["ratio_max"] = max(out["ratio_max"], stats["ratio_max"])
        out["train_tokens"] += stats.get("train_tokens", 0.0)
        w_sum += stats.get("is_w_sum", 0.0)
        w_sq += stats.get("is_w_sq_sum", 0.0)
        for k in _WEIGHTED:
            if k in stats:
                sums[k] += stats[k] * n
    for k in _WEIGHTED:
        if k != "kl_ref" or with_ref:
            out[k] = sums[k] / max(out["num_tokens"], 1.0)
    out["is_w_sum"], out["is_w_sq_sum"] = w_sum, w_sq
    out["ess"] = ess(w_sum, w_sq, out["num_tokens"])
    return out

"""A training job on your model and your data: a local Hugging Face causal LM
(``[train.model] path``) trained on a dataset (``[train.data]``, read and tokenized
by :mod:`phalanx.data.text`) by FT-DDP, HSDP or DiLoCo.

The model spec is the RL side's (:class:`~phalanx.config.model.ModelSection`), with
the same loading and the same one-line errors (:func:`phalanx.rl.model.load_model`).
Sample ``i`` of the data is a pure function of the dataset, the tokenizer, the
settings and ``i``, so the elastic sampler's guarantees hold unchanged: a run with
failures trains exactly the global batches of a calm one.

**The loss** of a sample is its mean next-token cross-entropy over the tokens that
have one (all of a packed pretraining sequence; the response of an SFT row), and a
step's loss is the mean over the global batch's samples: :meth:`HFTask.compute`
returns a micro-batch's summed sample losses and backpropagates them times the
manager's ``1 / global_batch_size``, so the gradient does not depend on how the
batch was split over replicas and micro-batches.

**Memory and speed.** ``train.precision = "bf16"`` computes under autocast while
the weights, their gradients and the optimizer's moments stay fp32 (master
weights); ``train.activation_checkpointing`` recomputes activations in the
backward pass (HF's gradient checkpointing); ``train.micro_batch_size`` bounds
what one forward holds. :meth:`HFTask.figures` gives every step line its
``tokens_per_s``, ``mfu`` and ``peak_mem_mb`` (:mod:`phalanx.train.perf`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F  # noqa: N812

from phalanx.jobs.base import JobError
from phalanx.train.perf import mfu, peak_memory_mb, peak_tflops

if TYPE_CHECKING:
    from phalanx.config.train import TrainSection
    from phalanx.data.text import TextData

log = logging.getLogger("phalanx.train")

IGNORE = -100
"""The label of a token with no loss (Hugging Face's convention)."""


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The compute-dtype context of ``precision`` on ``device`` (a no-op for fp32)."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def sample_losses(model: Any, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each sample's mean next-token cross-entropy over the tokens that have a label
    ([batch]). The logits are taken in float32 at least, whatever the autocast (a
    float64 model keeps them in float64)."""
    logits = model(input_ids=ids).logits[:, :-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    target = labels[:, 1:]
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=IGNORE,
        reduction="none",
    ).view(target.shape)  # fmt: skip
    counted = (target != IGNORE).sum(dim=1)
    return ce.sum(dim=1) / counted.clamp(min=1)


@dataclass
class HFTask:
    """The model, its data and the step's compute of one replica (or one rank)."""

    tc: TrainSection
    model: Any
    data: TextData
    val: TextData | None
    device: torch.device
    params: int
    peak: float | None
    """The device's peak TFLOP/s in the job's precision (None on a CPU: no MFU)."""

    def compute(self, indices: list[int], scale: float, always_forward: bool = False) -> float:
        """Forward and backward of samples ``indices``; returns their summed loss. With
        ``always_forward`` an empty micro-batch still runs one (its loss times zero): a
        sharded replica's ranks must all take part in each other's collectives."""
        if self.tc.step_delay_s:
            time.sleep(self.tc.step_delay_s)  # a stand-in for a bigger model (tests, demos)
        if not indices and not always_forward:
            return 0.0
        ids, labels = self.data.batch(indices or [0])
        ids, labels = ids.to(self.device), labels.to(self.device)
        with autocast(self.tc.precision, self.device):
            losses = sample_losses(self.model, ids, labels)
        loss_sum = losses.sum() if indices else losses.sum() * 0.0
        (loss_sum * scale).backward()
        return float(loss_sum.detach())

    @torch.no_grad()
    def val_loss(self) -> float | None:
        """Mean loss over the first ``data.val_samples`` validation samples (the same
        ones every time), in eval mode; None without a validation split."""
        if self.val is None or self.tc.data is None:
            return None
        n = min(len(self.val), self.tc.data.val_samples)
        mb = self.tc.micro_batch_size or n
        was = self.model.training
        self.model.eval()
        total = 0.0
        try:
            for i in range(0, n, mb):
                ids, labels = self.val.batch(list(range(i, min(n, i + mb))))
                with autocast(self.tc.precision, self.device):
                    total += float(
                        sample_losses(self.model, ids.to(self.device), labels.to(self.device)).sum()
                    )
        finally:
            self.model.train(was)
        return total / max(n, 1)

    def figures(self, step_s: float, world: int, ranks: int = 1) -> dict[str, float]:
        """The step line's performance figures for a committed step that took
        ``step_s`` (commit to commit): the global batch's tokens per second, MFU over
        every device of the ``world`` replicas of ``ranks`` ranks, and this process's
        peak memory."""
        tokens = self.tc.global_batch_size * self.data.seq_len
        out: dict[str, float] = {
            "tokens_per_s": round(tokens / step_s, 1) if step_s > 0 else 0.0,
            "peak_mem_mb": round(peak_memory_mb(self.device), 1),
        }
        m = mfu(self.params, tokens, step_s, self.peak, world * ranks)
        if m is not None:
            out["mfu"] = round(m, 4)
        return out


def build(tc: TrainSection, seed: int, device: torch.device) -> HFTask:
    """The HF task of ``tc`` on ``device``: the model loaded from ``tc.model.path``
    (master weights in ``train.dtype``, fp32 by default; checkpointing as asked) and its data. JobError in one line
    for a bad model or data."""
    from phalanx.config.model import ModelSection
    from phalanx.data.text import DataError, load_text_data
    from phalanx.rl.model import checkpoint_activations, load_model, num_params

    spec = tc.model
    if not isinstance(spec, ModelSection) or spec.path is None or tc.data is None:
        raise JobError("an HF training job needs [train.model] path and [train.data]")
    try:
        model: Any = load_model(spec.path, spec.attn_implementation)
    except ValueError as e:
        raise JobError(str(e).replace("model.path", "train.model.path")) from e
    if tc.activation_checkpointing:
        try:
            checkpoint_activations(model, "train.activation_checkpointing")
        except ValueError as e:
            raise JobError(str(e)) from e
    if tc.lora is not None:  # a peft model: the base frozen, the adapter trained
        from phalanx.rl.lora import apply_lora

        try:
            model = apply_lora(model, tc.lora, spec.seed, key="train.lora")
        except ValueError as e:
            raise JobError(str(e)) from e
    model = model.to(device=device, dtype=getattr(torch, tc.dtype)).train()
    context = getattr(model.config, "max_position_embeddings", None)
    try:
        data = load_text_data(tc.data, spec.path, split="train", seed=seed, max_positions=context)
        has_val = bool(tc.data.validation or tc.data.validation_fraction)
        val = (
            load_text_data(tc.data, spec.path, split="validation", seed=seed, max_positions=context)
            if has_val
            else None
        )
    except DataError as e:
        raise JobError(str(e)) from e
    rows = model.get_input_embeddings().num_embeddings
    if data.max_token_id >= rows:
        raise JobError(
            f"train.model.path's vocabulary must cover the data's token ids: the model has "
            f"{rows} embedding rows, the data (tokenized with the tokenizer in "
            f"{spec.path}) holds id {data.max_token_id}. Save the model and its tokenizer "
            "together (the model's own tokenizer), or resize the model's embeddings."
        )
    peak = peak_tflops(device, tc.precision, tc.peak_tflops)
    return HFTask(tc, model, data, val, device, num_params(model), peak)

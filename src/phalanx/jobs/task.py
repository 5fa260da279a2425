"""What a training replica trains (``train.model``): the model, its data, and the
``compute`` the manager runs on a share of the global batch, as one :class:`Task`.

- your model (a ``[train.model]`` table): a local Hugging Face causal LM on
  ``[train.data]`` (:mod:`phalanx.jobs.hf_task`);
- ``mlp`` (:mod:`phalanx.jobs.mlp`): an MLP regressing a fixed random function;
- ``transformer``: the small transformer of :mod:`phalanx.train.tp` (built
  whole, unsharded) learning next-token prediction on counting sequences: each
  row counts up from a random start by a random stride, mod the vocabulary.
  A sample's loss is its mean next-token cross-entropy.

Every replica starts from the same weights (a built-in task's from the job seed,
yours from its directory) and reads the same dataset.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812

from phalanx.config import TrainSection
from phalanx.config.model import ModelSection
from phalanx.jobs import mlp
from phalanx.train.manager import Compute


@dataclass
class Task:
    """One replica's (or rank's) model, data and step compute."""

    model: torch.nn.Module
    """The model the optimizer trains (a sharded replica shards it in place of this)."""
    dataset_size: int
    """Samples the elastic sampler draws from: the same on every replica."""
    compute: Compute
    figures: Callable[[float, int, int], dict[str, float]] = lambda step_s, world, ranks: {}
    """``figures(step_s, world, ranks)``: a committed step's ``tokens_per_s``, ``mfu``
    and ``peak_mem_mb`` for its line (a built-in task reports none)."""
    val_loss: Callable[[], float | None] = lambda: None
    """The validation loss now (None: no validation split)."""
    val_every: int = 0
    """Steps between validation losses (``data.val_every``; 0: never)."""


def build(
    tc: TrainSection,
    seed: int,
    device: torch.device,
    always_forward: bool = False,
    wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
) -> Task:
    """The task of ``tc`` on ``device``. ``wrap`` replaces the model before anything
    uses it (a sharded replica shards it with FSDP2). With ``always_forward`` an empty
    micro-batch still runs forward and backward (a sharded model's ranks must all take
    part in each one's collectives). JobError in one line for a bad model or data."""
    if isinstance(tc.model, ModelSection):
        from phalanx.jobs import hf_task

        t = hf_task.build(tc, seed, device)
        if wrap is not None:
            t.model = wrap(t.model)

        def compute(indices: list[int], scale: float) -> float:
            return t.compute(indices, scale, always_forward)

        every = tc.data.val_every if tc.data is not None else 0
        return Task(t.model, len(t.data), compute, t.figures, t.val_loss, every)
    model = build_model(tc, seed).to(device)
    if wrap is not None:
        model = wrap(model)
    return Task(model, tc.dataset_size, make_compute(tc, model, seed, always_forward, device))


def build_model(tc: TrainSection, seed: int) -> torch.nn.Module:
    if tc.model == "mlp":
        return mlp.build_model(tc, seed)
    from phalanx.train import tp

    cfg = tp.TPConfig(
        vocab=tc.vocab,
        d_model=tc.d_model,
        n_heads=tc.n_heads,
        d_hidden=4 * tc.d_model,
        n_layers=tc.n_layers,
        seq=tc.seq,
        seed=seed,
        lr=tc.lr,
        dtype=getattr(torch, tc.dtype),
    )
    return tp.build_model(cfg, None)


def build_tokens(tc: TrainSection, seed: int) -> torch.Tensor:
    """``[dataset_size, seq + 1]`` counting sequences from the job seed."""
    g = torch.Generator().manual_seed(seed + 1)
    start = torch.randint(tc.vocab, (tc.dataset_size, 1), generator=g)
    stride = torch.randint(1, 4, (tc.dataset_size, 1), generator=g)
    return (start + stride * torch.arange(tc.seq + 1)) % tc.vocab


def make_compute(
    tc: TrainSection,
    model: torch.nn.Module,
    seed: int,
    always_forward: bool = False,
    device: torch.device | None = None,
) -> Compute:
    """The built-in task's ``compute(indices, scale)``, its data on ``device`` (the
    CPU by default). With ``always_forward`` an empty micro-batch still runs forward
    and backward (a sharded model's ranks must all take part in each one's
    collectives)."""
    dev = device or torch.device("cpu")
    if tc.model == "mlp":
        x, y = mlp.build_data(tc, seed)
        return mlp.make_compute(model, x.to(dev), y.to(dev), tc.step_delay_s, always_forward)
    tokens = build_tokens(tc, seed).to(dev)

    def compute(indices: list[int], scale: float) -> float:
        if tc.step_delay_s:
            time.sleep(tc.step_delay_s)
        if not indices and not always_forward:
            return 0.0
        rows = tokens[torch.as_tensor(indices, dtype=torch.long, device=dev)]
        logits = model(rows[:, :-1])
        per_token = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1), reduction="none"
        )
        loss_sum = per_token.view(len(indices), tc.seq).mean(dim=1).sum()
        (loss_sum * scale).backward()
        return float(loss_sum.detach())

    return compute

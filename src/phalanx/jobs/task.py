"""The built-in FT task a replica trains (``train.model``): the model, its data,
and the ``compute`` the manager runs on a share of the global batch.

- ``mlp`` (:mod:`phalanx.jobs.mlp`): an MLP regressing a fixed random function;
- ``transformer``: the small transformer of :mod:`phalanx.train.tp` (built
  whole, unsharded) learning next-token prediction on counting sequences: each
  row counts up from a random start by a random stride, mod the vocabulary.
  A sample's loss is its mean next-token cross-entropy.

Both are built from the job seed alone, so every replica starts from the same
weights and reads the same dataset.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F  # noqa: N812

from phalanx.config import TrainSection
from phalanx.jobs import mlp
from phalanx.train.manager import Compute


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
    tc: TrainSection, model: torch.nn.Module, seed: int, always_forward: bool = False
) -> Compute:
    """The task's ``compute(indices, scale)``. With ``always_forward`` an empty
    micro-batch still runs forward and backward (a sharded model's ranks must all
    take part in each one's collectives)."""
    if tc.model == "mlp":
        x, y = mlp.build_data(tc, seed)
        return mlp.make_compute(model, x, y, tc.step_delay_s, always_forward)
    tokens = build_tokens(tc, seed)

    def compute(indices: list[int], scale: float) -> float:
        if tc.step_delay_s:
            time.sleep(tc.step_delay_s)
        if not indices and not always_forward:
            return 0.0
        rows = tokens[torch.as_tensor(indices, dtype=torch.long)]
        logits = model(rows[:, :-1])
        per_token = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1), reduction="none"
        )
        loss_sum = per_token.view(len(indices), tc.seq).mean(dim=1).sum()
        (loss_sum * scale).backward()
        return float(loss_sum.detach())

    return compute

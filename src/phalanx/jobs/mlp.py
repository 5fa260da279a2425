"""The built-in FT job's task: an MLP regressing a fixed random function on
synthetic data generated from the job seed. It is small enough for tests on
CPU and has everything a real job has: a dataset read through the
exactly-once sampler, a constant global batch, an optimizer with state."""

from __future__ import annotations

import itertools
import time

import torch

from phalanx.config import TrainSection
from phalanx.train.manager import Compute


def build_model(tc: TrainSection, seed: int) -> torch.nn.Module:
    """Same initial weights on every replica: the first quorum needs no heal."""
    torch.manual_seed(seed)
    dims = [tc.in_dim, *tc.hidden]
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(dims):
        layers += [torch.nn.Linear(a, b), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(dims[-1], tc.out_dim))
    return torch.nn.Sequential(*layers).to(getattr(torch, tc.dtype))


def build_data(tc: TrainSection, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    dtype = getattr(torch, tc.dtype)
    x = torch.randn(tc.dataset_size, tc.in_dim, generator=g, dtype=torch.float64)
    w = torch.randn(tc.in_dim, tc.out_dim, generator=g, dtype=torch.float64) / tc.in_dim**0.5
    y = torch.tanh(x @ w) + 0.01 * torch.randn(
        tc.dataset_size, tc.out_dim, generator=g, dtype=torch.float64
    )
    return x.to(dtype), y.to(dtype)


def build_optimizer(tc: TrainSection, model: torch.nn.Module) -> torch.optim.Optimizer:
    """The optimizer of ``tc`` over ``model``'s trainable parameters (with
    ``[train.lora]``: the adapter's; the frozen base has no optimizer state)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if tc.optimizer == "sgd":
        return torch.optim.SGD(params, lr=tc.lr, momentum=tc.momentum, weight_decay=tc.weight_decay)
    return torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay)


def make_compute(
    model: torch.nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    delay_s: float = 0.0,
    always_forward: bool = False,
) -> Compute:
    """``compute(indices, scale)`` for the manager. With ``always_forward`` an empty
    micro-batch still runs forward and backward (a sharded model's ranks must all
    take part in each one's collectives)."""

    def compute(indices: list[int], scale: float) -> float:
        if delay_s:
            time.sleep(delay_s)
        if not indices and not always_forward:
            return 0.0
        idx = torch.as_tensor(indices)
        per_sample = ((model(x[idx]) - y[idx]) ** 2).mean(dim=1)
        loss_sum = per_sample.sum()
        (loss_sum * scale).backward()
        return float(loss_sum.detach())

    return compute

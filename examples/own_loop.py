"""Your own PyTorch training loop, fault tolerant: phalanx as a library.

    phalanx run examples/own_loop.toml                      # 3 replicas
    phalanx run examples/own_loop.toml --chaos kill-every=8 # and SIGKILL one now and then

The loop below is plain PyTorch; ``phalanx.Replica`` makes it one replica of the job:
a quorum per step, the gradients all-reduced and the step committed everywhere or
nowhere, a restarted replica healed from a live peer, and a constant global batch
(``compute`` gets this replica's share of it as sample indices). Started by
``phalanx run`` (``[train] script``), ``phalanx replica``, the agent or Ray, it
finds its controller by itself; under another launcher, set ``PHALANX_CONTROLLER``.
"""

import torch
import torch.nn.functional as F  # noqa: N812

import phalanx

torch.manual_seed(0)  # every replica starts from the same weights and the same data
x = torch.randn(4096, 32)
y = torch.tanh(x @ torch.randn(32, 8))
model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)


def compute(indices: list[int], scale: float) -> float:
    """Forward and backward on samples ``indices``; ``scale`` is 1 / global batch."""
    loss = F.mse_loss(model(x[indices]), y[indices], reduction="sum")
    (loss * scale).backward()
    return loss.item()


with phalanx.Replica(model, optimizer, dataset_size=len(x), global_batch_size=64) as replica:
    while not replica.done:
        r = replica.train_step(compute)
        if r.committed and r.step % 50 == 0:
            print(f"step {r.step}: loss {r.loss:.5f} over {r.participants} replicas", flush=True)

"""A small tensor-parallel transformer (DTensor over gloo on CPU).

Megatron-style tensor parallelism (Shoeybi et al. 2019, arXiv:1909.08053)
over the ``"tp"`` dimension of a ``(dp, tp)`` DeviceMesh, replicated over
``"dp"``: the fused QKV projection, the MLP's up projection and the output
head are column-parallel (``Shard(0)`` of the weight), the attention's
output and the MLP's down projection are row-parallel (``Shard(1)``);
embedding and norms are replicated plain tensors. The MLP's hidden width
(66 by default) does not divide by every TP size, so its shards are uneven.

Its layout-independent state, what universal checkpoints save and reshard,
is :mod:`phalanx.train.tp_state`.

With ``tp == 1`` the model is plain modules, and with no torch.distributed
at all (``mesh=None``) everything runs in one process.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

FUSED_PARTS = ("q", "k", "v")


@dataclass(frozen=True)
class TPConfig:
    """Shape of the model and of its synthetic data."""

    vocab: int = 30
    """Vocabulary size; 30 over TP=4 gives uneven head shards (8, 8, 8, 6)."""
    d_model: int = 24
    n_heads: int = 4
    """Must divide by the TP size: each TP rank owns whole heads."""
    d_hidden: int = 66
    """MLP width; 66 over TP=4 gives uneven shards (17, 17, 17, 15)."""
    n_layers: int = 2
    seq: int = 8
    seed: int = 0
    lr: float = 3e-3
    dtype: torch.dtype = torch.float64


class FusedLinear(nn.Linear):
    """A column-parallel projection whose output is the logical matrices
    ``FUSED_PARTS`` (q, k, v) stacked. Each TP rank's local weight is the
    stack of its own rows of every part."""

    parts: tuple[str, ...] = FUSED_PARTS


class Attention(nn.Module):
    def __init__(self, cfg: TPConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.qkv = FusedLinear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # Local to this TP rank: [b, t, 3 * d_local], its heads only.
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        heads = q.shape[-1] // self.head_dim

        def split(z: torch.Tensor) -> torch.Tensor:
            return z.reshape(b, t, heads, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: TPConfig):
        super().__init__()
        self.up = nn.Linear(cfg.d_model, cfg.d_hidden)
        self.down = nn.Linear(cfg.d_hidden, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: TPConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    """Token embedding, ``n_layers`` pre-norm blocks, final norm, output head.

    ``mesh`` is the ``(dp, tp)`` mesh the model lives on (None without
    torch.distributed); parameters are DTensors over ``mesh["tp"]`` when
    ``tp > 1`` and plain tensors otherwise."""

    def __init__(self, cfg: TPConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)
        self.mesh: DeviceMesh | None = None

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    @property
    def tp(self) -> int:
        return self.mesh["tp"].size() if self.mesh is not None else 1


def local_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; a plain tensor as is."""
    return t.to_local() if isinstance(t, DTensor) else t


def make_mesh(dp: int, tp: int) -> DeviceMesh | None:
    """The ``(dp, tp)`` CPU mesh over the default process group, or None when
    torch.distributed is not initialised (then ``dp == tp == 1``). Collective:
    every rank calls it with the same sizes."""
    if not (dist.is_available() and dist.is_initialized()):
        if dp * tp != 1:
            raise ValueError(
                f"dp x tp must be 1 without torch.distributed: got {dp} x {tp}. "
                f"Initialise a process group (e.g. run under torchrun) first."
            )
        return None
    world = dist.get_world_size()
    if dp * tp != world:
        raise ValueError(
            f"dp x tp must equal the world size: got {dp} x {tp}, expected product {world}. "
            f"Pick sizes whose product is the number of ranks."
        )
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def _interleave_fused(w: torch.Tensor, parts: int, tp: int) -> torch.Tensor:
    """Reorder a fused ``[parts * n, ...]`` weight so that its r-th contiguous
    1/tp slice is rank r's rows of every part: ``[q_0; k_0; v_0; q_1; ...]``."""
    pieces = [p.chunk(tp) for p in w.chunk(parts)]
    return torch.cat([pieces[i][r] for r in range(tp) for i in range(parts)])


def build_model(cfg: TPConfig, mesh: DeviceMesh | None) -> TinyTransformer:
    """The model on ``mesh``, the same initial weights on every rank and for
    every layout (it is built whole from ``cfg.seed``, then sharded). Not a
    collective beyond what ``parallelize_module`` does (nothing on CPU)."""
    tp = mesh["tp"].size() if mesh is not None else 1
    if cfg.n_heads % tp or cfg.d_model % cfg.n_heads:
        raise ValueError(
            f"n_heads must divide by the TP size and d_model by n_heads: got n_heads="
            f"{cfg.n_heads}, d_model={cfg.d_model}, tp={tp}. Each TP rank must own whole heads."
        )
    torch.manual_seed(cfg.seed)
    model = TinyTransformer(cfg).to(cfg.dtype)
    model.mesh = mesh
    if mesh is None or tp == 1:
        return model
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, FusedLinear):
                m.weight.copy_(_interleave_fused(m.weight, len(m.parts), tp))
    plan: dict[str, Any] = {"head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(cfg.n_layers):
        plan |= {
            f"blocks.{i}.attn.qkv": ColwiseParallel(),
            f"blocks.{i}.attn.out": RowwiseParallel(),
            # A DTensor, not its local shard, goes on to the down projection: its
            # global width is 66 however unevenly it is split, whereas
            # RowwiseParallel would rebuild it from a local shard as if even.
            f"blocks.{i}.mlp.up": ColwiseParallel(use_local_output=False),
            f"blocks.{i}.mlp.down": RowwiseParallel(),
        }
    parallelize_module(model, mesh["tp"], plan)
    return model


def make_optimizer(model: TinyTransformer) -> torch.optim.AdamW:
    """AdamW with two param groups (no weight decay on norms and biases).
    ``foreach=False``: one list may mix DTensor and plain parameters."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=model.cfg.lr, betas=(0.9, 0.95), foreach=False)


# -- training ------------------------------------------------------------


def batch_for_step(cfg: TPConfig, step: int, size: int) -> torch.Tensor:
    """The global batch of ``step``: ``[size, seq + 1]`` tokens that depend only
    on ``(cfg.seed, step)``, so any layout, resumed anywhere, sees the same
    data. Each row counts up from a random start by a random stride (mod
    vocab), which a model can learn from context."""
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    start = torch.randint(cfg.vocab, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    return (start + stride * torch.arange(cfg.seq + 1)) % cfg.vocab


def train_step(model: TinyTransformer, opt: torch.optim.Optimizer, batch: torch.Tensor) -> float:
    """One optimizer step on this DP rank's rows of the global ``batch``;
    returns the global mean loss. Collective over the whole mesh (TP inside
    the model, then one gradient all-reduce over ``dp``): every rank calls it
    with the same global batch, whose size must divide by dp."""
    mesh = model.mesh
    dp = mesh["dp"].size() if mesh is not None else 1
    if batch.shape[0] % dp:
        raise ValueError(
            f"global batch must divide by dp: got {batch.shape[0]} rows over dp={dp}. "
            f"Pick a batch size that is a multiple of every DP size you run."
        )
    rows = batch.chunk(dp)[mesh["dp"].get_local_rank() if mesh is not None else 0]
    logits = model(rows[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    value = loss.detach().reshape(1)
    if mesh is not None and dp > 1:
        # One flat all-reduce for every gradient (and the loss): a handful of
        # tiny tensors would cost one gloo round trip each.
        grads = [local_of(p.grad) for p in model.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads] + [value])
        dist.all_reduce(flat, group=mesh.get_group("dp"))
        flat /= dp
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        value = flat[-1:]
    opt.step()
    return float(value.item())


@torch.no_grad()
def evaluate(model: TinyTransformer, batch: torch.Tensor) -> float:
    """Mean next-token loss of the whole ``batch`` (no step). Collective over
    tp (every rank of the mesh calls it with the same batch)."""
    logits = model(batch[:, :-1])
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)))

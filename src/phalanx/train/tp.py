"""A small tensor-parallel transformer (DTensor over gloo on CPU) and its
layout-independent state: what universal checkpoints save and reshard.

Megatron-style tensor parallelism (Shoeybi et al. 2019, arXiv:1909.08053)
over the ``"tp"`` dimension of a ``(dp, tp)`` DeviceMesh, replicated over
``"dp"``: the fused QKV projection, the MLP's up projection and the output
head are column-parallel (``Shard(0)`` of the weight), the attention's
output and the MLP's down projection are row-parallel (``Shard(1)``);
embedding and norms are replicated plain tensors. The MLP's hidden width
(66 by default) does not divide by every TP size, so its shards are uneven.

The fused QKV weight ``[3d, d]`` is the catch. Each TP rank must hold *its
heads'* q, k and v rows, so its local shard is ``[q_r; k_r; v_r]``, not a
contiguous slice of ``[q; k; v]``: the global tensor behind that DTensor is
a TP-dependent permutation of the logical one. The state therefore never
names the fused weight. It exposes the logical sub-tensors ``<fqn>.q``,
``<fqn>.k`` and ``<fqn>.v`` (each ``Shard(0)`` over tp), cut from the
local fused shard, and loading puts the local fused shard back together
from them. The optimizer's moments are treated the same way.

State trees (:func:`model_state`, :func:`optim_state`) are keyed by logical
FQNs and hold views of the live tensors, so a checkpoint loaded into them
fills the model and the optimizer in place, whatever layout saved it.

With ``tp == 1`` the model is plain modules, and with no torch.distributed
at all (``mesh=None``) everything runs in one process.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
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
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
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


# -- layout-independent state --------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))


def logical_params(model: TinyTransformer) -> Iterator[tuple[str, nn.Parameter, int | None]]:
    """``(logical key, parameter, part)`` of every logical tensor: a fused
    parameter appears once per part (``blocks.0.attn.qkv.q`` with part 0, ...),
    any other parameter once under its FQN with part None."""
    fused = {
        id(m.weight): (name, m.parts)
        for name, m in model.named_modules()
        if isinstance(m, FusedLinear)
    }
    for name, p in model.named_parameters():
        if id(p) in fused:
            base, parts = fused[id(p)]
            for i, part in enumerate(parts):
                yield f"{base}.{part}", p, i
        else:
            yield name, p, None


def _logical_shape(p: torch.Tensor, part: int | None) -> tuple[int, ...]:
    shape = tuple(p.shape)
    return shape if part is None else (shape[0] // len(FUSED_PARTS), *shape[1:])


def _view(
    model: TinyTransformer, p: nn.Parameter, t: torch.Tensor, part: int | None
) -> torch.Tensor:
    """The logical tensor ``part`` of ``t`` (``p`` itself or optimizer state laid
    out like it), sharing ``t``'s memory: a plain tensor when ``p`` is one, else
    a DTensor on the whole mesh, replicated over dp and sharded like ``p`` over tp."""
    local = _local(t.detach())
    if part is not None:
        local = local.chunk(len(FUSED_PARTS))[part]
    if not isinstance(p, DTensor) or model.mesh is None:
        return local
    shape = _logical_shape(p, part)
    placements = [Replicate()] * (model.mesh.ndim - 1) + [p.placements[0]]
    return DTensor.from_local(
        local, model.mesh, placements, shape=torch.Size(shape), stride=_contiguous_stride(shape)
    )


def _fill(
    model: TinyTransformer, key: str, p: nn.Parameter, target: torch.Tensor, values: list[Any]
) -> None:
    """Copy the logical tensors ``values`` (one per part of ``p``; each a full
    plain tensor or a DTensor in any layout) into ``target``'s local shard."""
    pieces = []
    for i, v in enumerate(values):
        part = i if len(values) > 1 else None
        shape = _logical_shape(p, part)
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != shape:
            got = list(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(
                f"state tensor {key!r} must have the model's shape: got {got}, expected "
                f"{list(shape)}. The state is from another model config."
            )
        if isinstance(v, DTensor):
            same = (
                v.device_mesh == model.mesh
                and isinstance(p, DTensor)
                and (v.placements[-1] == p.placements[0])
            )
            v = v.to_local() if same else v.full_tensor()
        elif isinstance(p, DTensor):
            v = distribute_tensor(v, p.device_mesh, p.placements, src_data_rank=None).to_local()
        pieces.append(v)
    with torch.no_grad():
        _local(target).copy_(torch.cat(pieces) if len(pieces) > 1 else pieces[0])


def _grouped(
    model: TinyTransformer,
) -> dict[int, tuple[nn.Parameter, list[str]]]:
    """id(param) -> (param, its logical keys in part order)."""
    out: dict[int, tuple[nn.Parameter, list[str]]] = {}
    for key, p, _ in logical_params(model):
        out.setdefault(id(p), (p, []))[1].append(key)
    return out


def model_state(model: TinyTransformer) -> dict[str, torch.Tensor]:
    """The model's logical state: FQN -> a view of the live parameter (fused
    ones split into their parts). Filling these tensors in place (as
    ``Checkpointer.load`` does) loads the model. Not a collective; every rank
    of the mesh gets its own views."""
    return {key: _view(model, p, p, part) for key, p, part in logical_params(model)}


def load_model_state(model: TinyTransformer, sd: dict[str, Any]) -> None:
    """Load a logical state (full plain tensors, or DTensors in any layout,
    keyed like :func:`model_state`) into the model. Collective over the mesh
    only if some value is a DTensor in another layout (it is gathered);
    raises ValueError naming the first missing or misshapen key."""
    missing = [k for k, _, _ in logical_params(model) if k not in sd]
    if missing:
        raise ValueError(
            f"model state must hold every parameter: got {len(missing)} missing, e.g. "
            f"{missing[0]!r}. The state is from another model config."
        )
    for p, keys in _grouped(model).values():
        _fill(model, keys[0], p, p, [sd[k] for k in keys])


def _init_adam_state(opt: torch.optim.Optimizer) -> None:
    """Give every parameter the state Adam(W) creates at its first step, so
    that a freshly built optimizer can be a template to load into."""
    if not isinstance(opt, torch.optim.Adam | torch.optim.AdamW):
        raise TypeError(
            f"optimizer must be Adam or AdamW to be checkpointed here: got "
            f"{type(opt).__name__}. Add its state layout to phalanx.train.tp."
        )
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in opt.param_groups:
        for p in group["params"]:
            st = opt.state[p]
            if st:
                continue
            st["step"] = torch.tensor(0.0, dtype=scalar)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def optim_state(model: TinyTransformer, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's logical state: ``{"state": {key: {"step": float,
    "exp_avg": view, ...}}, "param_groups": [{..., "params": [key, ...]}]}``
    with the keys of :func:`model_state` (a fused parameter's moments split
    the same way), so it is independent of the layout. Tensors are views of
    the live optimizer state; a parameter that has no state yet gets Adam's
    zero state first. Not a collective."""
    _init_adam_state(opt)
    grouped = _grouped(model)
    state: dict[str, Any] = {}
    for key, p, part in logical_params(model):
        st = opt.state[p]
        entry: dict[str, Any] = {"step": float(st["step"])}
        for name, t in st.items():
            if name != "step" and isinstance(t, torch.Tensor):
                entry[name] = _view(model, p, t, part)
        state[key] = entry
    groups = []
    for g in opt.param_groups:
        hyper = {k: v for k, v in g.items() if k != "params"}
        groups.append({**hyper, "params": [k for p in g["params"] for k in grouped[id(p)][1]]})
    return {"state": state, "param_groups": groups}


def load_optim_state(
    model: TinyTransformer, opt: torch.optim.Optimizer, osd: dict[str, Any]
) -> None:
    """Load a logical optimizer state (as :func:`optim_state` returns, or as
    a checkpoint gives it back: full plain tensors or DTensors in any layout)
    into ``opt``: hyperparameters of each group, then each parameter's step
    and moments. The groups must list the same keys in the same order.
    Collective like :func:`load_model_state`."""
    _init_adam_state(opt)
    mine = optim_state(model, opt)["param_groups"]
    theirs = osd["param_groups"]
    if [g["params"] for g in theirs] != [g["params"] for g in mine]:
        raise ValueError(
            f"optimizer param_groups must list the model's parameters: got "
            f"{[len(g['params']) for g in theirs]} keys per group, expected "
            f"{[len(g['params']) for g in mine]}. The state is from another model or optimizer."
        )
    missing = [k for g in mine for k in g["params"] if k not in osd["state"]]
    if missing:
        raise ValueError(
            f"optimizer state must hold every parameter: got {len(missing)} missing, e.g. "
            f"{missing[0]!r}. The state is from another model or optimizer."
        )
    for g, saved in zip(opt.param_groups, theirs, strict=True):
        g.update({k: v for k, v in saved.items() if k != "params"})
    for p, keys in _grouped(model).values():
        entries = [osd["state"][k] for k in keys]
        st = opt.state[p]
        st["step"] = torch.tensor(entries[0]["step"], dtype=st["step"].dtype)
        for name, t in st.items():
            if name != "step" and isinstance(t, torch.Tensor):
                _fill(model, keys[0], p, t, [e[name] for e in entries])


def gathered_state(
    model: TinyTransformer, opt: torch.optim.Optimizer | None = None
) -> dict[str, Any]:
    """``{"model": {key: full tensor}, "optim": ...}``: the logical state as
    full plain tensors (copies), for comparisons and export. Collective over
    the mesh (each TP-sharded tensor is all-gathered): every rank calls it and
    gets the same tree."""

    def full(t: Any) -> Any:
        if isinstance(t, DTensor):
            return t.full_tensor()
        return t.clone() if isinstance(t, torch.Tensor) else t

    out: dict[str, Any] = {"model": {k: full(v) for k, v in model_state(model).items()}}
    if opt is not None:
        osd = optim_state(model, opt)
        out["optim"] = {
            "state": {k: {n: full(v) for n, v in e.items()} for k, e in osd["state"].items()},
            "param_groups": osd["param_groups"],
        }
    return out

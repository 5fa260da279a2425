"""The layout-independent state of :mod:`phalanx.train.tp`'s transformer: what
universal checkpoints save and reshard.

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
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from phalanx.train.tp import FUSED_PARTS, FusedLinear, TinyTransformer, local_of


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
    local = local_of(t.detach())
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
        local_of(target).copy_(torch.cat(pieces) if len(pieces) > 1 else pieces[0])


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

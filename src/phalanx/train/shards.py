"""This rank's part of a sharded replica's state (:mod:`phalanx.train.hsdp`):
its DTensors' local shards, the gradient buckets it all-reduces with its
counterparts in the other replicas, and the sharding of full tensors (a
checkpoint's, saved by a replica of any size) into this rank's shards."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from phalanx.comm.base import Communicator


def shard_model(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    """FSDP2 over the replica's ranks (``mesh``): each transformer block is its own
    unit, then the root. A Hugging Face model names its block classes
    (``_no_split_modules``); the built-in transformer keeps them in ``blocks``; in
    any other model each layer with parameters is a unit. Parameters shared
    between layers (tied embeddings) stay in the root's unit. Gradients are summed
    over the ranks, not averaged (the loss is already scaled by 1 / global batch),
    with plain sums (gloo has no pre-multiplied sum)."""
    from torch.distributed.fsdp import fully_shard

    names = set(getattr(model, "_no_split_modules", None) or ())
    blocks = getattr(model, "blocks", None)
    if names:
        units = [m for m in model.modules() if type(m).__name__ in names]
    elif isinstance(blocks, torch.nn.ModuleList):
        units = list(blocks)
    else:
        units = [
            m for m in model.modules() if m is not model and any(True for _ in m.parameters(False))
        ]
    # The units' outputs are views (reshapes, splits) that nothing changes in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    for m in [*units, model]:
        fully_shard(m, mesh=mesh)
        m.set_gradient_divide_factor(1.0)  # type: ignore[operator]  # (each unit's own)
        m.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``t`` (``t`` itself when it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_tree(x: Any) -> Any:
    """A state tree with every DTensor replaced by this rank's shard."""
    if isinstance(x, torch.Tensor):
        return local(x)
    if isinstance(x, dict):
        return {k: local_tree(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(local_tree(v) for v in x)
    return x


class ShardedGrads:
    """This rank's gradient shards, summed over its cross-replica group in
    flat buckets together with the commit vote and the loss (as
    :class:`~phalanx.train.grads.GradBuffer` does for whole gradients). FSDP2
    owns ``.grad``: the shards are copied into the buckets and back."""

    def __init__(self, model: torch.nn.Module, bucket_bytes: int):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.bucket_bytes = bucket_bytes
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        self.layout: list[tuple[tuple[torch.dtype, torch.device], int]] = []
        """Each parameter's shard's place: (its flat's key, offset in it)."""
        for p in self.params:
            key = (p.dtype, local(p).device)
            self.layout.append((key, sizes.get(key, 0)))
            sizes[key] = sizes.get(key, 0) + local(p).numel()
        self.flats = {k: torch.zeros(n, dtype=k[0], device=k[1]) for k, n in sizes.items()}
        self.meta = torch.zeros(2, dtype=torch.float64)
        self.vote_ok = False
        self.local = True
        """``.grad`` holds this rank's own shards (the sums go to ``.grad`` only at
        :meth:`publish`, once the whole replica voted yes): a failed exchange
        leaves the step's gradients whole, for the retry to build on."""
        self._views: list[torch.Tensor] = []

    def views_of(
        self, flats: dict[tuple[torch.dtype, torch.device], torch.Tensor]
    ) -> list[torch.Tensor]:
        """Each parameter's shard's view into ``flats`` (laid out as :attr:`flats`)."""
        views = []
        for p, (key, off) in zip(self.params, self.layout, strict=True):
            shard = local(p)
            views.append(flats[key][off : off + shard.numel()].view_as(shard))
        return views

    def buckets_of(
        self, flats: dict[tuple[torch.dtype, torch.device], torch.Tensor]
    ) -> list[torch.Tensor]:
        """The buckets of ``flats`` (laid out as :attr:`flats`)."""
        buckets = []
        for flat in flats.values():
            per = max(1, self.bucket_bytes // flat.element_size())
            buckets += [flat[i : i + per] for i in range(0, flat.numel(), per)]
        return buckets

    @property
    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.flats.values())

    def zero(self) -> None:
        for p in self.params:
            p.grad = None
        self.local = True

    def allreduce(
        self, comm: Communicator, world_size: int, loss_sum: float, vote: bool = True
    ) -> float:
        if self.meta.device != comm.device:
            self.meta = torch.zeros(2, dtype=torch.float64, device=comm.device)
        views = self.views_of(self.flats)
        take_grads(self.params, views)
        buckets = self.buckets_of(self.flats)
        self.meta[0] = 1.0 if vote else 0.0
        self.meta[1] = loss_sum
        self.vote_ok = False
        comm.allreduce([*buckets, self.meta], "sum")
        self._views = views
        self.vote_ok = round(self.meta[0].item()) == world_size
        return float(self.meta[1])

    def publish(self) -> None:
        """Put the summed gradients of the last all-reduce into ``.grad`` (for the
        optimizer step)."""
        for p, view in zip(self.params, self._views, strict=True):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            local(p.grad).copy_(view)
        self.local = False


def take_grads(params: list[torch.nn.Parameter], views: list[torch.Tensor]) -> None:
    """Copy each parameter's gradient shard into its view (zeros where it has none)."""
    for p, view in zip(params, views, strict=True):
        if p.grad is None:
            view.zero_()
        else:
            view.copy_(local(p.grad))


def shard_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's shard of ``full`` (a whole tensor, the same on every rank) laid
    out as ``like`` (a DTensor); ``full`` itself when ``like`` is not sharded. No
    communication: each rank cuts its own part."""
    if not isinstance(like, DTensor):
        return full
    if tuple(full.shape) != tuple(like.shape):
        raise ValueError(
            f"a whole tensor of shape {tuple(full.shape)} cannot be sharded like a parameter "
            f"of shape {tuple(like.shape)}: the state is from another model"
        )
    part = distribute_tensor(
        full.to(like.dtype), like.device_mesh, like.placements, src_data_rank=None
    )
    return part.to_local()


def checkpoint_to_local(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, sd: dict[str, Any]
) -> dict[str, Any]:
    """A loaded checkpoint's state (:meth:`~phalanx.checkpoint.Checkpointer.load` with
    the model's ``state_dict()`` as template) as this rank's local shards, for
    :func:`load_local`: the model's DTensors were filled in place by DCP (any saving
    layout, any loading one: FSDP, TP or both on a 2-D mesh); the optimizer's state
    came whole, and each rank cuts its shard like its parameter's. No communication."""
    mine = model.state_dict()
    out_model = {
        k: local(v) if isinstance(v, DTensor) else shard_like(v, mine[k])
        for k, v in sd["model"].items()
        if k in mine
    }
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {
        pid: {
            k: shard_like(v, params[int(pid)]) if isinstance(v, torch.Tensor) and v.dim() else v
            for k, v in st.items()
        }
        for pid, st in sd["optimizer"]["state"].items()
    }
    return {**sd, "model": out_model, "optimizer": {**sd["optimizer"], "state": state}}


def load_local(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    sd: dict[str, Any],
    trainable_only: bool = False,
) -> None:
    """Load a state of this rank's local shards (a heal's, or :func:`checkpoint_to_local`'s)
    into ``model`` and ``optimizer``: each shard is copied into its parameter's local
    tensor, and the optimizer's shards become DTensors laid out like their parameters.
    With ``trainable_only`` the state's model holds the trainable tensors alone (a LoRA
    adapter: :mod:`phalanx.train.trainable`)."""
    from phalanx.train.trainable import model_state

    with torch.no_grad():
        for k, v in model_state(model, trainable_only).items():
            local(v).copy_(sd["model"][k])
    params = [p for g in optimizer.param_groups for p in g["params"]]
    osd = sd["optimizer"]
    state = {}
    for pid, st in osd["state"].items():
        p = params[int(pid)]
        state[pid] = {
            k: DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
            if isinstance(p, DTensor) and isinstance(v, torch.Tensor) and v.dim()
            else v
            for k, v in st.items()
        }
    optimizer.load_state_dict({**osd, "state": state})


def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """``torch.nn.utils.clip_grad_norm_`` for a replica whose gradients live on
    several meshes, or on none: a TP x FSDP model holds 2-D DTensors next to
    1-D ones (norms, FSDP's alone) or plain tensors (norms when FSDP has one rank),
    and torch's foreach norm refuses to mix them. The norm is taken per mesh (each
    a collective over the replica's ranks when sharded: every rank calls this),
    combined, and every gradient is scaled by one factor. Returns the total norm."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(mesh, []).append(p.grad)
    squares = 0.0
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads)
        whole = norm.full_tensor() if isinstance(norm, DTensor) else norm
        squares += float(whole) ** 2
    total = squares**0.5
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:
        with torch.no_grad():
            for grads in groups.values():
                torch._foreach_mul_(grads, coef)
    return total

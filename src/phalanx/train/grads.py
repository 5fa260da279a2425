"""Gradients in flat buffers, all-reduced in buckets with no copy.

Each parameter's ``.grad`` is a view into one flat buffer per dtype and
device, so backward accumulates straight into the buffer and the
all-reduce runs on slices of it (the buckets). A two-element side tensor
travels with the buckets: the count of participants that vote to commit
and the summed loss, so the commit vote costs no extra round trip. On a
patient communicator (:attr:`~phalanx.comm.base.Communicator.patient`) it is an
all-reduce of its own, after the buckets: a replica that gave the buckets' op up
(a peer stopped or cut off) leaves the group and never joins that one, so a peer
that completes the buckets against its abandoned op cannot count its vote.
"""

from __future__ import annotations

import torch

from phalanx.comm.base import Communicator


class GradBuffer:
    def __init__(self, model: torch.nn.Module, bucket_bytes: int = 25 << 20):
        groups: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
        for p in model.parameters():
            if p.requires_grad:
                groups.setdefault((p.dtype, p.device), []).append(p)
        self.flats: list[torch.Tensor] = []
        self.layout: list[tuple[torch.nn.Parameter, int, int]] = []
        """Each parameter's place: (parameter, flat, offset in it)."""
        self.bounds: list[tuple[int, int, int]] = []
        """Each bucket's place: (flat, start, stop)."""
        for (dtype, device), params in groups.items():
            f = len(self.flats)
            self.flats.append(
                torch.zeros(sum(p.numel() for p in params), dtype=dtype, device=device)
            )
            off = 0
            for p in params:
                self.layout.append((p, f, off))
                off += p.numel()
            per = max(1, bucket_bytes // self.flats[f].element_size())
            self.bounds += [(f, i, min(i + per, off)) for i in range(0, off, per)]
        self.views = self.views_of(self.flats)
        self.buckets = self.buckets_of(self.flats)
        self.meta = torch.zeros(2, dtype=torch.float64)
        self.vote_ok = False
        self.local = True
        """The buffers hold this replica's own gradients (zeroed or accumulated
        since), not a sum or a partial sum of an all-reduce."""
        self.bind()

    def views_of(self, flats: list[torch.Tensor]) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """Each parameter's gradient view into ``flats`` (laid out as :attr:`flats`)."""
        return [(p, flats[f][off : off + p.numel()].view_as(p)) for p, f, off in self.layout]

    def buckets_of(self, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        """The buckets of ``flats`` (laid out as :attr:`flats`)."""
        return [flats[f][a:b] for f, a, b in self.bounds]

    @property
    def nbytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.flats)

    def bind(self) -> None:
        """Point every ``.grad`` at its view (after a ``zero_grad(set_to_none=True)``)."""
        for p, v in self.views:
            if p.grad is None or p.grad.data_ptr() != v.data_ptr():
                p.grad = v

    def zero(self) -> None:
        self.bind()
        for f in self.flats:
            f.zero_()
        self.local = True

    def allreduce(
        self, comm: Communicator, world_size: int, loss_sum: float, vote: bool = True
    ) -> float:
        """Sum gradients over the group; returns the group's summed loss. Sets
        :attr:`vote_ok` when every participant voted to commit."""
        self.bind()
        if self.meta.device != comm.device:
            self.meta = torch.zeros(2, dtype=torch.float64, device=comm.device)
        self.meta[0] = 1.0 if vote else 0.0
        self.meta[1] = loss_sum
        self.vote_ok = False
        self.local = False  # summed in place, even if the all-reduce fails midway
        if comm.patient:
            comm.allreduce(self.buckets, "sum")
            comm.allreduce([self.meta], "sum")
        else:
            comm.allreduce([*self.buckets, self.meta], "sum")
        self.vote_ok = round(self.meta[0].item()) == world_size
        return float(self.meta[1])

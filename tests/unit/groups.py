"""An in-process group of k members (threads) whose collectives reduce the members'
tensors in a random order, for tests that must not depend on the order of a sum.
It meets the :class:`~phalanx.comm.base.Communicator` contract for all-reduce only."""

from __future__ import annotations

import random
import threading

import torch

from phalanx.comm.base import Communicator

_OPS = {"sum": torch.add, "max": torch.maximum, "min": torch.minimum}


class Hub:
    """What the members of one group share: a barrier, their inputs, and a count of
    the collectives run."""

    def __init__(self, k: int, seed: int = 0):
        self.k = k
        self.barrier = threading.Barrier(k, timeout=60)
        self.inputs: list[list[torch.Tensor]] = [[] for _ in range(k)]
        self.result: list[torch.Tensor] = []
        self.rng = random.Random(seed)
        self.collectives = 0

    def comms(self) -> list[Shuffled]:
        return [Shuffled(self, r) for r in range(self.k)]


class Shuffled(Communicator):
    def __init__(self, hub: Hub, rank: int):
        self.hub, self.rank, self.world_size = hub, rank, hub.k

    def configure(self, store_addr: str, prefix: str, rank: int, world_size: int) -> None:
        raise NotImplementedError("a Shuffled group is made whole by its Hub")

    def allreduce(self, tensors: list[torch.Tensor], op: str = "sum") -> None:
        hub = self.hub
        hub.inputs[self.rank] = [t.clone() for t in tensors]
        if hub.barrier.wait() == 0:
            order = list(range(hub.k))
            hub.rng.shuffle(order)
            acc = [t.clone() for t in hub.inputs[order[0]]]
            for r in order[1:]:
                acc = [_OPS[op](a, t) for a, t in zip(acc, hub.inputs[r], strict=True)]
            hub.result = acc
            hub.collectives += 1
        hub.barrier.wait()
        for t, r in zip(tensors, hub.result, strict=True):
            t.copy_(r)
        hub.barrier.wait()  # every member has its copy before the next collective

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        raise NotImplementedError("not needed by the exact-sum tests")

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        raise NotImplementedError("not needed by the exact-sum tests")

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        raise NotImplementedError("not needed by the exact-sum tests")

    def abort(self) -> None:
        self.hub.barrier.abort()

"""The ranks of one replica (``[replica] ranks = N``, ``tp = T``) and the groups
they share inside it: the default group (FSDP's and TP's device mesh) and a gloo
group for the leader's control messages (:mod:`phalanx.train.hsdp`)."""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from phalanx.net import pin_gloo_interface

CONTROL_BYTES = 16 << 10
"""The first broadcast of a quorum carries this many bytes; a longer one costs a second."""


class ReplicaBroken(RuntimeError):
    """A rank of this replica failed (a collective inside the replica raised): the
    replica must be restarted as a whole."""


def env_ranks() -> tuple[int, int]:
    """(rank, ranks) of this process in its replica, from torchrun's environment."""
    try:
        rank, size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError as e:
        raise ValueError(f"RANK and WORLD_SIZE must be integers: {e}") from e
    if not 0 <= rank < size:
        raise ValueError(f"RANK must be in [0, WORLD_SIZE): got RANK={rank}, WORLD_SIZE={size}")
    return rank, size


class ReplicaRanks:
    """This process's place in its replica, and the replica's own groups: the
    default group (FSDP's mesh) and a gloo group for control messages.

    ``timeout_s`` bounds every control message; it must outlast the leader's
    longest wait for a quorum, which the other ranks wait through.

    With ``tp`` > 1 the ranks form a ``(dp, tp)`` mesh (:mod:`phalanx.train.tp_hf`):
    :attr:`mesh` is then its ``dp`` dimension (FSDP's) and :attr:`tp_mesh` its
    ``tp`` one; consecutive ranks share a TP group."""

    def __init__(self, timeout_s: float, device: torch.device | None = None, tp: int = 1):
        self.rank, self.size = env_ranks()
        if tp < 1 or self.size % tp:
            raise ValueError(f"replica.tp ({tp}) must divide the replica's ranks ({self.size})")
        self.tp = tp
        self.dp_rank, self.dp_size = self.rank // tp, self.size // tp
        """This rank's place among the replica's data-parallel ranks: the ranks of one
        TP group compute the same samples."""
        self.device = device or torch.device("cpu")
        timeout = datetime.timedelta(seconds=timeout_s)
        if self.device.type == "cuda":
            # NCCL's watchdog must give up on a hung collective before the control
            # plane's own timeouts do (the torchft seed's advice).
            os.environ.setdefault(
                "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC", str(max(1, int(timeout_s / 2)))
            )
        if not dist.is_initialized():
            pin_gloo_interface()  # ranks on several hosts: gloo on the advertised address
            backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, timeout=timeout)
        self.control: Any = dist.new_group(backend="gloo", timeout=timeout)
        self.tp_mesh: DeviceMesh | None = None
        if tp > 1:
            grid = init_device_mesh(
                self.device.type, (self.dp_size, tp), mesh_dim_names=("dp", "tp")
            )
            self.mesh, self.tp_mesh = grid["dp"], grid["tp"]
        else:
            self.mesh = init_device_mesh(self.device.type, (self.size,))

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def broadcast_json(self, value: Any = None) -> Any:
        """Rank 0's ``value`` (JSON-able) on every rank."""
        head = torch.zeros(CONTROL_BYTES, dtype=torch.uint8)
        data = b""
        if self.leader:
            data = json.dumps(value, separators=(",", ":")).encode()
            head[:8].view(torch.int64)[0] = len(data)
            inline = data[: CONTROL_BYTES - 8]
            head[8 : 8 + len(inline)] = torch.frombuffer(bytearray(inline), dtype=torch.uint8)
        self._run(lambda: dist.broadcast(head, 0, group=self.control), "broadcast")
        n = int(head[:8].view(torch.int64)[0])
        if n > CONTROL_BYTES - 8:
            rest = torch.zeros(n - (CONTROL_BYTES - 8), dtype=torch.uint8)
            if self.leader:
                rest.copy_(
                    torch.frombuffer(bytearray(data[CONTROL_BYTES - 8 :]), dtype=torch.uint8)
                )
            self._run(lambda: dist.broadcast(rest, 0, group=self.control), "broadcast")
            raw = head[8:].numpy().tobytes() + rest.numpy().tobytes()
        else:
            raw = head[8 : 8 + n].numpy().tobytes()
        return json.loads(raw)

    def sum(self, values: list[float]) -> list[float]:
        """The element-wise sum of ``values`` over the replica's ranks."""
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, values: list[float]) -> list[float]:
        """The element-wise maximum of ``values`` over the replica's ranks."""
        return self._reduce(values, dist.ReduceOp.MAX)

    def _reduce(self, values: list[float], op: Any) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        self._run(lambda: dist.all_reduce(t, op=op, group=self.control), "all-reduce")
        return [float(v) for v in t.tolist()]

    def _run(self, fn: Any, what: str) -> None:
        try:
            fn()
        except Exception as e:
            raise ReplicaBroken(f"a {what} inside the replica failed (a rank is gone): {e}") from e

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

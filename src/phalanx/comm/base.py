"""Interface of a replica-to-replica communicator that is rebuilt per quorum."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch


class CommError(RuntimeError):
    """A collective or point-to-point transfer failed (peer died, hung past the
    collective timeout, or the group was aborted). Recoverable: the caller does
    not commit the step, reports the peers, and retries with the next quorum."""


class Pending:
    """A collective started and not yet waited for (:meth:`Communicator.allreduce_start`).

    :meth:`wait` blocks until it is done (its tensors then hold the result), at most
    the communicator's timeout, and raises :class:`CommError` if it failed. Waiting
    again does nothing."""

    def __init__(self, finish: Callable[[], None] | None = None):
        self._finish = finish

    def wait(self) -> None:
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()


class Communicator(ABC):
    """Collectives among the replicas of one quorum.

    ``configure`` is called by every participant of a quorum with the same
    ``store_addr``/``prefix``; it is itself a rendezvous (a collective).
    Every other method is a collective (or a matched send/recv pair) over
    the configured group, raises :class:`CommError` on failure, and never
    blocks longer than the timeout given at construction.
    """

    rank: int = 0
    world_size: int = 1
    patient: bool = False
    """Whether a collective given up on a peer may still be running in this process
    (until the patience: :mod:`phalanx.comm.liveness`), so that a peer that resumes
    can complete its side of it. A commit vote is then an op of its own, after the
    data: a process that gave the data up never joins the vote."""
    device: torch.device = torch.device("cpu")
    """Where the tensors handed to this communicator must live (NCCL: the rank's GPU)."""

    @abstractmethod
    def configure(self, store_addr: str, prefix: str, rank: int, world_size: int) -> None: ...

    def watch(self, peers: dict[str, str]) -> None:
        """The other members of the configured group (name -> their store's
        ``host:port``), for a backend that tells a slow collective from a stuck one
        by asking them (:mod:`phalanx.comm.liveness`). Call after :meth:`configure`.
        A backend that does not ask gives collectives up at its timeout."""
        return None

    def enter_round(self, round_: int) -> None:
        """This replica took quorum round ``round_`` with the configured group: a
        backend that asks peers (see :meth:`watch`) tells them so, and counts a
        peer still at an older round (not told of this step's quorum) as absent."""
        return None

    @abstractmethod
    def allreduce(self, tensors: list[torch.Tensor], op: str = "sum") -> None:
        """In-place all-reduce of each tensor (``op``: sum, min or max)."""

    def allreduce_start(self, tensors: list[torch.Tensor], op: str = "sum") -> Pending:
        """Start an in-place all-reduce of each tensor and return at once: the caller
        does other work (Streaming DiLoCo's next inner steps) and waits for it later.
        Same contract as :meth:`allreduce` (every participant calls it, in the same
        order as its other collectives), but the tensors hold the result only after
        :meth:`Pending.wait`, and must not be touched before. This default runs the
        all-reduce now; backends with asynchronous collectives override it."""
        self.allreduce(tensors, op)
        return Pending()

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int) -> None: ...

    @abstractmethod
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None: ...

    @abstractmethod
    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None: ...

    def send_many(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> None:
        """Send ``tensors`` to ``dst`` in order (a backend may keep them all in flight)."""
        for t in tensors:
            self.send(t, dst, tag)

    def recv_many(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> None:
        """Receive into ``tensors`` in order, matching :meth:`send_many` or sends."""
        for t in tensors:
            self.recv(t, src, tag)

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (same shape and dtype on every rank), in rank
        order. This default is one broadcast per rank; backends override it."""
        out = []
        for r in range(self.world_size):
            buf = tensor.clone() if r == self.rank else torch.empty_like(tensor)
            self.broadcast(buf, r)
            out.append(buf)
        return out

    @abstractmethod
    def abort(self) -> None:
        """Tear down the group; pending and later operations fail fast."""

"""Weight sync by collective broadcast over a policy-to-rollout process group.

The group (the *mesh*) is the policy leader (rank 0) and the rollout
replicas of the controller's sync order. It is built once per ``mesh_id``
under its own store prefix, and rebuilt whenever the controller changes the
mesh (a join, an eviction, a new leader): Cosmos-RL's BuildMesh.

One sync is a header broadcast from rank 0, ``[version, layout fingerprint,
nbytes, bucket]``, then every tensor packed into one flat byte buffer, sent in
``bucket``-byte broadcasts (``streamed.py``). The fingerprint (names, shapes,
dtypes) makes a receiver with another model fail loudly instead of loading
garbage; it is checked on the header, before any weight moves. The leader sends
from its own thread, from a snapshot taken at the step boundary, so training
goes on while the rollout replicas join between their generation batches.

A receiver takes the buffer as a stream (:meth:`CollectiveWeightChannel.fetch_stream`):
each tensor is handed to the engine as soon as its bytes are in, while the next
buckets are still arriving, so an engine that reloads tensor by tensor (vLLM)
overlaps its reload with the transfer. A broadcast that breaks part-way raises
CommError from the stream; the engine then rolls back (all-or-nothing).

Rank 0 may also be a rollout replica (the rollout-to-rollout broadcast): a
receiver keeps the flat buffer of the version it fetched last (one copy of the
weights), and when the controller names it the source for a late joiner it
sends that buffer as it came, so the policy leader is not asked again for a
version it already sent.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Generator, Mapping
from concurrent.futures import Future
from functools import partial

import torch

from phalanx.comm.base import CommError
from phalanx.comm.torch_pg import TorchCommunicator
from phalanx.transport.base import Pairs, Report, Sends, SyncOrder, SyncResult, WeightChannel
from phalanx.transport.streamed import (
    BUCKET,
    drain_buckets,
    receive_stream,
    send_buckets,
    unpack,
)

__all__ = ["CollectiveWeightChannel", "Packed", "fingerprint", "pack", "unpack"]


def fingerprint(weights: Mapping[str, torch.Tensor]) -> int:
    """A 31-bit digest of the names, shapes and dtypes (sorted by name)."""
    text = ";".join(f"{k}:{tuple(t.shape)}:{t.dtype}" for k, t in sorted(weights.items()))
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


class Packed(dict[str, torch.Tensor]):
    """Named tensors that are views into one flat host buffer, laid out as
    :func:`pack` lays them out (sorted by name), so that packing them costs no
    copy. Made from the shapes and dtypes of ``like`` (meta tensors will do) and
    filled one tensor at a time (:meth:`fill`): a sharded policy gathers its
    whole tensors straight into it (:func:`phalanx.rl.policy_ranks.full_weights`)."""

    def __init__(self, like: Mapping[str, torch.Tensor]):
        super().__init__()
        nbytes = sum(t.numel() * t.element_size() for t in like.values())
        self.flat = torch.empty(nbytes, dtype=torch.uint8)
        off = 0
        for k in sorted(like):
            t = like[k]
            n = t.numel() * t.element_size()
            self[k] = self.flat[off : off + n].view(t.dtype).view(t.shape)
            off += n

    def fill(self, name: str, t: torch.Tensor) -> None:
        self[name].copy_(t.detach())


def pack(weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """Every tensor (sorted by name) as one flat uint8 buffer: a copy, safe to send
    while the source keeps training (a :class:`Packed` snapshot is its own buffer)."""
    if isinstance(weights, Packed):
        return weights.flat
    parts = [
        t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in sorted(weights.items())
    ]
    return torch.cat(parts).cpu() if parts else torch.empty(0, dtype=torch.uint8)


class CollectiveWeightChannel(WeightChannel):
    relays = True

    def __init__(self, timeout_s: float, device: torch.device | None = None, bucket: int = BUCKET):
        self.comm = TorchCommunicator(timeout_s, device)
        self.bucket = bucket
        """Bytes per broadcast when this channel sends (a receiver follows the header's)."""
        self._mesh: tuple[int, int, int] | None = None
        self._sends = Sends("phalanx-weights")
        self.pending: Future[SyncResult] | None = None
        """The leader's last send (tests and benchmarks wait on it)."""
        self.kept: tuple[int, int, torch.Tensor] | None = None
        """(version, layout fingerprint, flat buffer) of the last fetch, to relay."""

    def _configure(self, order: SyncOrder) -> None:
        key = (order.mesh_id, order.rank, len(order.members))
        if self._mesh != key:
            self._mesh = None
            self.comm.configure(order.store, f"weights/m{order.mesh_id}", *key[1:])
            self._mesh = key

    def _fail(self) -> None:
        # A failed collective leaves the group unusable: rebuild it on the next order.
        self._mesh = None
        self.comm.abort()

    def publish(
        self, version: int, weights: Mapping[str, torch.Tensor], order: SyncOrder, report: Report
    ) -> None:
        if order.rank != 0:
            raise ValueError(f"publish must be called by the mesh's rank 0: got rank {order.rank}.")
        flat, fp = pack(weights), fingerprint(weights)
        send = partial(self._send, version, flat, fp, order, report)
        self.pending = self._sends.submit(order, version, send, report)

    def relay(self, order: SyncOrder, version: int) -> SyncResult:
        if order.rank != 0:
            raise ValueError(f"relay must be called by the mesh's rank 0: got rank {order.rank}.")
        if self.kept is None or self.kept[0] != version:
            held = "none" if self.kept is None else f"version {self.kept[0]}"
            return SyncResult(
                order.seq,
                version,
                False,
                0.0,
                0,
                len(order.members),
                f"this replica cannot relay version {version}: it keeps {held} (the controller "
                f"names another source next time)",
            )
        _, fp, flat = self.kept
        return self._send(version, flat, fp, order, lambda res: None)

    def _send(
        self, version: int, flat: torch.Tensor, fp: int, order: SyncOrder, report: Report
    ) -> SyncResult:
        t0 = time.perf_counter()
        try:
            self._configure(order)
            dev = self.comm.device  # NCCL takes only tensors on its GPU
            header = [version, fp, flat.numel(), self.bucket]
            self.comm.broadcast(torch.tensor(header, dtype=torch.int64, device=dev), 0)
            send_buckets(self.comm, flat.to(dev), self.bucket)
            res = SyncResult(
                order.seq, version, True, time.perf_counter() - t0, flat.numel(), len(order.members)
            )
        except CommError as e:
            self._fail()
            res = SyncResult(
                order.seq, version, False, time.perf_counter() - t0, 0, len(order.members), str(e)
            )
        report(res)
        return res

    def fetch(
        self, order: SyncOrder, like: Mapping[str, torch.Tensor]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        version, stream = self.fetch_stream(order, like)
        return version, dict(stream)

    def fetch_stream(self, order: SyncOrder, like: Mapping[str, torch.Tensor]) -> tuple[int, Pairs]:
        """Take the header (a layout that is not ``like``'s: the buckets are drained and
        CommError raised, before any weight moves), then stream the tensors as their
        buckets arrive. The buffer becomes :attr:`kept` (to relay) once the stream
        ended whole; a broken one aborts the group (rebuilt on the next order)."""
        try:
            self._configure(order)
            dev = self.comm.device
            header = torch.zeros(4, dtype=torch.int64, device=dev)
            self.comm.broadcast(header, 0)
            version, fp, nbytes, bucket = (int(x) for x in header.tolist())
            if bucket < 1 or nbytes < 0:
                raise CommError(f"a weight sync's header is malformed: got {header.tolist()}")
            want = fingerprint(like)
            expected = sum(t.numel() * t.element_size() for t in like.values())
            if fp != want or nbytes != expected:
                drain_buckets(self.comm, nbytes, bucket, dev)
        except CommError:
            self._fail()
            raise
        if fp != want or nbytes != expected:
            raise CommError(
                f"weights from the sync's source must match this replica's model: got layout "
                f"{fp:#x} ({nbytes} bytes), expected {want:#x} ({expected} bytes). Start every "
                f"replica with the same [rl.model] config."
            )
        flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        return version, self._stream(version, fp, flat, like, bucket)

    def _stream(
        self,
        version: int,
        fp: int,
        flat: torch.Tensor,
        like: Mapping[str, torch.Tensor],
        bucket: int,
    ) -> Generator[tuple[str, torch.Tensor], None, None]:
        try:
            yield from receive_stream(self.comm, flat, like, bucket)
        except CommError:
            self._fail()
            raise
        self.kept = (version, fp, flat)

    def close(self) -> None:
        self._sends.shutdown()
        self._fail()

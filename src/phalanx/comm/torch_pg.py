"""A :class:`Communicator` over torch.distributed process groups: gloo on CPU,
NCCL on CUDA. A new group is built for each quorum, under a fresh store
prefix, so that a group never mixes members of two quorums.

The rendezvous store is a ``TCPStore`` served by each replica's rank 0
(:func:`serve_store`) and advertised to the controller as the replica's
address; the quorum's rank-0 member's store is the rendezvous point.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm.base import CommError, Communicator
from phalanx.net import LOOPBACK, AddressError, advertise_host, hostport, unreachable

_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}

CONNECT_S = 3.5
"""The least time a new group's connections get to set up (the store client, gloo's
full mesh), whatever the collective timeout: a lost SYN is sent again after 1 s,
and again 2 s later, so under packet loss a 1 s setup budget failed every other
rebuild (and each failure meant another quorum and another rebuild). Collectives
still time out after the collective timeout: :meth:`TorchCommunicator._wait`."""


def serve_store(host: str | None = None) -> tuple[dist.TCPStore, str]:
    """Start this replica's rendezvous store on a free port. Returns (store,
    "host:port"), where host is the address peers reach it by (``host``, else
    :func:`phalanx.net.advertise_host`). The store listens on every interface."""
    host = host or advertise_host()
    # The store's own client connects over loopback (the server listens on every
    # interface); peers use the advertised address, checked here first.
    store = dist.TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False, use_libuv=True)
    address = hostport(host, store.port)
    if unreachable({"self": address}, timeout_s=2.0):
        raise AddressError(
            f"the advertised address {host!r} must be an address of this host: this "
            f"replica cannot reach its own store at {address}. Set --advertise-host (or "
            f"$PHALANX_ADVERTISE_HOST) to this host's address, or iface:NAME."
        )
    return store, address


class TorchCommunicator(Communicator):
    def __init__(self, timeout_s: float, device: torch.device | None = None):
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.connect_timeout = datetime.timedelta(seconds=max(timeout_s, CONNECT_S))
        self.device = device or torch.device("cpu")
        self._store: tuple[str, dist.TCPStore] | None = None
        """The rendezvous store client of the last quorum, kept while the next quorum
        meets at the same store: no new connection (under packet loss, a SYN lost)."""
        self.host = advertise_host()
        """The address this rank's gloo pairs bind and announce to their peers (the
        host name's address is loopback on many machines: useless to another host)."""
        # Any: the torch stubs lack send/recv/abort on the backend classes.
        self.pg: Any = None
        self.rank, self.world_size = 0, 1

    def configure(self, store_addr: str, prefix: str, rank: int, world_size: int) -> None:
        self.abort()
        try:
            store = dist.PrefixStore(prefix, self._store_client(store_addr))
            if self.device.type == "cuda":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = self.timeout
                self.pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
            else:
                opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                opts._timeout = self.connect_timeout  # the full mesh's setup
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
                self.pg = dist.ProcessGroupGloo(store, rank, world_size, opts)
                # Collectives: the collective timeout inside gloo too, not only in
                # _wait: a group whose op timed out is dropped, and dropping it waits
                # for gloo's own timeout of that op.
                self.pg.set_timeout(self.timeout)
        except Exception as e:  # rendezvous failed: a peer is gone or the store host died
            self.pg, self._store = None, None
            raise CommError(f"process group rendezvous at {store_addr}/{prefix} failed: {e}") from e
        self.rank, self.world_size = rank, world_size

    def _store_client(self, store_addr: str) -> dist.TCPStore:
        if self._store is not None and self._store[0] == store_addr:
            return self._store[1]
        host, port = store_addr.rsplit(":", 1)
        client = dist.TCPStore(
            host.strip("[]"),
            int(port),
            is_master=False,
            timeout=self.connect_timeout,
            wait_for_workers=False,
            use_libuv=True,
        )
        self._store = (store_addr, client)
        return client

    def _group(self) -> Any:
        if self.pg is None:
            raise CommError("no process group: configure() has not succeeded for this quorum")
        return self.pg

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            work.wait(self.timeout)
        except Exception as e:
            raise CommError(f"{what} failed: {e}") from e

    def allreduce(self, tensors: list[torch.Tensor], op: str = "sum") -> None:
        pg = self._group()
        try:
            works = [pg.allreduce([t], _OPS[op]) for t in tensors]
        except Exception as e:
            raise CommError(f"allreduce failed to start: {e}") from e
        for w in works:
            self._wait(w, "allreduce")

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        try:
            work = self._group().broadcast([tensor], opts)
        except Exception as e:
            raise CommError(f"broadcast failed to start: {e}") from e
        self._wait(work, "broadcast")

    def allgather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        try:
            work = self._group().allgather([out], [tensor.contiguous()])
        except Exception as e:
            raise CommError(f"allgather failed to start: {e}") from e
        self._wait(work, "allgather")
        return out

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.send_many([tensor], dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> None:
        self.recv_many([tensor], src, tag)

    def send_many(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> None:
        """Send ``tensors`` to ``dst`` in order, as :meth:`send` one by one would, but
        with every send in flight at once. Gloo moves a message only once the peer
        has posted its receive (one round trip each), so a many-tensor transfer
        sent one blocking call at a time pays that round trip per tensor."""
        pg = self._group()
        try:
            works = [pg.send([t], dst, tag) for t in tensors]
        except Exception as e:
            raise CommError(f"send to rank {dst} failed to start: {e}") from e
        for w in works:
            self._wait(w, f"send to rank {dst}")

    def recv_many(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> None:
        """Receive into ``tensors`` in order (matching :meth:`send_many` or a series of
        :meth:`send`), with every receive posted at once."""
        pg = self._group()
        try:
            works = [pg.recv([t], src, tag) for t in tensors]
        except Exception as e:
            raise CommError(f"recv from rank {src} failed to start: {e}") from e
        for w in works:
            self._wait(w, f"recv from rank {src}")

    def abort(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.abort()
            except Exception:
                pass  # best effort: the group is being discarded either way

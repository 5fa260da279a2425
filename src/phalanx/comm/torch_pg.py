"""A :class:`Communicator` over torch.distributed process groups: gloo on CPU,
NCCL on CUDA. A new group is built for each quorum, under a fresh store
prefix, so that a group never mixes members of two quorums.

The rendezvous store is a ``TCPStore`` served by each replica's rank 0
(:func:`serve_store`) and advertised to the controller as the replica's
address; the quorum's rank-0 member's store is the rendezvous point.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from phalanx.comm import liveness
from phalanx.comm.base import CommError, Communicator, Pending
from phalanx.net import LOOPBACK, AddressError, advertise_host, hostport, unreachable

log = logging.getLogger("phalanx.comm")

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
    liveness.respond(store.port)  # the peers' pings, at the same port number over UDP
    if unreachable({"self": address}, timeout_s=2.0):
        raise AddressError(
            f"the advertised address {host!r} must be an address of this host: this "
            f"replica cannot reach its own store at {address}. Set --advertise-host (or "
            f"$PHALANX_ADVERTISE_HOST) to this host's address, or iface:NAME."
        )
    return store, address


class TorchCommunicator(Communicator):
    """``backend``: ``nccl`` or ``gloo`` (default: NCCL on a GPU, gloo on the CPU; gloo
    moves CUDA tensors too). ``patience_s`` (gloo on the CPU only; 0: off): how long a
    collective may run past
    ``timeout_s`` while every peer of the group answers liveness pings as a member
    (:mod:`phalanx.comm.liveness`; the peers' addresses come from :meth:`watch`).
    Without it, or without peers watched, a collective is given up at ``timeout_s``."""

    def __init__(
        self,
        timeout_s: float,
        device: torch.device | None = None,
        patience_s: float = 0.0,
        backend: str | None = None,
    ):
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.connect_timeout = datetime.timedelta(seconds=max(timeout_s, CONNECT_S))
        self.device = device or torch.device("cpu")
        self.backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        """``nccl``, or ``gloo`` (also with the tensors on a GPU: ``train.data_plane``)."""
        gloo = self.device.type == "cpu"
        self.patience_s = max(patience_s, timeout_s) if patience_s > 0 and gloo else 0.0
        self._watch = liveness.Watch() if self.patience_s else None
        self.patient = self._watch is not None
        self._held_group = ""
        """The group this communicator holds (store and prefix), for liveness."""
        self._gave_up = False
        """A patient op of the group held was given up (gloo may still run it)."""
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
        self._held_group = f"{store_addr}/{prefix}"
        liveness.join(self._held_group)
        try:
            store = dist.PrefixStore(prefix, self._store_client(store_addr))
            if self.backend == "nccl":
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = self.timeout
                self.pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
            else:
                opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                opts._timeout = self.connect_timeout  # the full mesh's setup
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
                self.pg = dist.ProcessGroupGloo(store, rank, world_size, opts)
                # Collectives: gloo gives an op up at the longest _wait allows (a
                # group dropped with an op in flight is destroyed in the background).
                patience = datetime.timedelta(seconds=self.patience_s)
                self.pg.set_timeout(max(self.timeout, patience))
        except Exception as e:  # rendezvous failed: a peer is gone or the store host died
            self.pg, self._store = None, None
            self._leave()
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

    def watch(self, peers: dict[str, str]) -> None:
        if self._watch is not None:
            self._watch.set(self._held_group, peers)

    def enter_round(self, round_: int) -> None:
        if self._held_group:
            liveness.enter(self._held_group, round_)
        if self._watch is not None:
            self._watch.at(round_)

    def _wait(self, work: dist.Work, what: str) -> None:
        if self._watch is None:
            try:
                work.wait(self.timeout)
            except Exception as e:
                raise CommError(f"{what} failed: {e}") from e
            return
        try:
            self._wait_patiently(work, what)
        except CommError:
            self._leave()  # this group is broken: peers waiting on it give up now
            self._gave_up = True
            raise

    def _wait_patiently(self, work: dist.Work, what: str) -> None:
        """Wait for ``work`` up to the patience, from a thread of its own (gloo's wait
        on a send or receive fails the whole group when its own timeout passes, so
        it gets the patience at once), and give it up after the collective timeout
        as soon as a peer does not answer as a member of the group."""
        assert self._watch is not None
        start = time.monotonic()
        waiter = _Waiter(work, datetime.timedelta(seconds=self.patience_s))
        timeout = slice_ = self.timeout.total_seconds()
        self._watch.begin()
        last = start
        try:
            while not waiter.done.wait(slice_):
                now = time.monotonic()
                waited = now - start
                if now - last > slice_ + liveness.ALIVE_S / 2 and waited < self.patience_s:
                    # This process did not run (SIGSTOP, a VM paused, no CPU): what it
                    # did not hear meanwhile says nothing of its peers, which may have
                    # been stopped with it and need CPU to catch up. They get a whole
                    # collective timeout from now, as if the op had begun now.
                    self._watch.rearm()
                    last, slice_ = now, timeout
                    continue
                last = now
                silent = self._watch.silent()
                if silent or waited >= self.patience_s:
                    why = (
                        f"peer(s) {', '.join(silent)} silent or gone from the group"
                        if silent
                        else f"the patience ({self.patience_s:g} s) is spent"
                    )
                    raise CommError(f"{what} timed out after {waited:.2f} s: {why}")
                if slice_ == timeout:
                    log.info(
                        "%s still running after %.2f s; every peer answers: waiting", what, waited
                    )
                slice_ = liveness.INTERVAL_S
        finally:
            self._watch.end()
        if waiter.error is not None:
            raise CommError(f"{what} failed: {waiter.error}") from waiter.error

    def _private(self, tensors: list[torch.Tensor], contents: bool = True) -> list[torch.Tensor]:
        """The tensors an op that writes may be handed. A patient communicator gives
        up an op while gloo still runs it (until the patience), and that op may still
        complete if a stopped peer resumes: it must write into memory of its own,
        never into a bucket or a model the next step uses. Copied back on success
        (:func:`_back`); the op's own tensors otherwise."""
        if self._watch is None:
            return tensors
        return [t.clone() if contents else torch.empty_like(t) for t in tensors]

    def allreduce(self, tensors: list[torch.Tensor], op: str = "sum") -> None:
        self.allreduce_start(tensors, op).wait()

    def allreduce_start(self, tensors: list[torch.Tensor], op: str = "sum") -> Pending:
        pg = self._group()
        bufs = self._private(tensors)
        try:
            works = [pg.allreduce([t], _OPS[op]) for t in bufs]
        except Exception as e:
            raise CommError(f"allreduce failed to start: {e}") from e

        def finish() -> None:
            for w in works:
                self._wait(w, "allreduce")
            _back(tensors, bufs)

        return Pending(finish)

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        bufs = self._private([tensor])
        try:
            work = self._group().broadcast(bufs, opts)
        except Exception as e:
            raise CommError(f"broadcast failed to start: {e}") from e
        self._wait(work, "broadcast")
        _back([tensor], bufs)

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
        bufs = self._private(tensors, contents=False)
        try:
            works = [pg.recv([t], src, tag) for t in bufs]
        except Exception as e:
            raise CommError(f"recv from rank {src} failed to start: {e}") from e
        for w in works:
            self._wait(w, f"recv from rank {src}")
        _back(tensors, bufs)

    def _leave(self) -> None:
        """Stop answering pings as a member of the group held (see :mod:`liveness`)."""
        if self._held_group:
            liveness.leave(self._held_group)
            self._held_group = ""

    def abort(self) -> None:
        pg, self.pg = self.pg, None
        self._leave()
        if self._watch is not None:
            self._watch.clear()
        if pg is not None:
            try:
                pg.abort()
            except Exception:
                pass  # best effort: the group is being discarded either way
            if self._gave_up:
                # Destroying a group joins its worker, which waits out an op in flight
                # up to gloo's timeout of it (the patience). A thread of its own holds
                # the group until then and drops it, so that neither this thread nor
                # one that drops a reference later (a traceback's frame) waits for it.
                box, delay = [pg], self.patience_s + 1.0
                del pg
                threading.Thread(
                    target=_drop_after, args=(box, delay), name="phalanx-pg-drop", daemon=True
                ).start()
        self._gave_up = False


def _back(tensors: list[torch.Tensor], bufs: list[torch.Tensor]) -> None:
    for t, b in zip(tensors, bufs, strict=True):
        if b is not t:
            t.copy_(b)


def _drop_after(box: list[Any], delay_s: float) -> None:
    time.sleep(delay_s)
    box.clear()


class _Waiter:
    """``work.wait(timeout)`` on a daemon thread; :attr:`done` is set when it returns.
    A wait that is given up goes on in the background until the op ends (at gloo's
    timeout of it at the latest), holding only its thread."""

    def __init__(self, work: dist.Work, timeout: datetime.timedelta):
        self.done = threading.Event()
        self.error: Exception | None = None
        threading.Thread(
            target=self._run, args=(work, timeout), name="phalanx-wait", daemon=True
        ).start()

    def _run(self, work: dist.Work, timeout: datetime.timedelta) -> None:
        try:
            work.wait(timeout)
        except Exception as e:
            self.error = e
        self.done.set()

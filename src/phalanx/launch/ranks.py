"""Start the N ranks of one replica, torchrun-style, and fail them together.

Usage::

    python -m phalanx.launch.ranks --nproc N -- COMMAND [ARGS...]

It serves the replica's rendezvous store (a ``TCPStore`` on a free port, as
torchrun's agent does) and starts ``COMMAND`` N times with torchrun's
environment: ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT`` and ``TORCHELASTIC_USE_AGENT_STORE``, so that
``init_process_group("env://")`` joins this store.

A replica is the unit of failure (DESIGN.md, replicas of several ranks):

- when one rank exits with an error or a signal, the others are SIGKILLed at
  once and this process exits with that rank's status (a signal ``S`` as
  ``128 + S``): the launcher sees one failed replica and restarts all of it;
- when rank 0 exits cleanly, the others get a grace period to do the same;
- SIGTERM and SIGINT are passed on to every rank (a drain);
- the ranks stay in this process's group, so a signal to the group (SIGSTOP,
  SIGKILL) reaches the whole replica, and each rank dies with this process
  (``PR_SET_PDEATHSIG``) if it is killed alone.

Unlike torchrun it never restarts ranks itself: the replica is restarted by
whoever supervises this process, and heals from a peer replica.

A replica across hosts: one launcher per host, each with ``--nnodes M
--node-rank K --master-addr HOST:PORT``, ``HOST`` an address of node rank 0
that the others reach. Node 0 serves the store on ``HOST:PORT``; every rank
gets ``MASTER_ADDR=HOST`` and its global rank ``K * N + LOCAL_RANK`` of ``M *
N``. Node K waits (``--rdzv-timeout-s``) until that store answers, and once
it stops answering (node 0's launcher is gone, and with it the replica) gives
its ranks :data:`MASTER_GRACE_S` to end by themselves before it stops them
and exits 1; a rank gone on another host fails the replica's next
collective, which ends the ranks here as it does on one host. Start the
launchers of every node again together: the store lives as long as node 0's.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch.distributed as dist

from phalanx.launch.procs import die_with_parent
from phalanx.launch.rank_forks import fork_rank, forkable, rank_of
from phalanx.net import LOOPBACK, hostport, parse_hostport, unreachable

EXIT_GRACE_S = 30.0
"""How long the other ranks get to exit once rank 0 has exited cleanly."""
WATCH_S = 0.5
"""How often node K checks that node rank 0's store still answers."""
MASTER_GRACE_S = 5.0
"""How long node K's ranks get to end once node rank 0's store is gone."""


DEFAULT_PORT = 29500
"""The store's port on node 0 when ``--master-addr`` names none (torchrun's)."""


@dataclass(frozen=True)
class Nodes:
    """Where this launcher's ranks sit in a replica that may span hosts."""

    nnodes: int = 1
    node_rank: int = 0
    master: str = LOOPBACK
    """Node rank 0's address, where its store listens (``MASTER_ADDR``)."""
    port: int = 0
    """The store's port on node 0 (0: a free one, on one host only)."""
    timeout_s: float = 300.0
    """How long node K waits for node 0's store to answer."""

    def check(self) -> Nodes:
        """Raise ValueError, one line, on a bad combination; else return self."""
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1: got {self.nnodes}.")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank must be in [0, --nnodes): got --node-rank {self.node_rank} with "
                f"--nnodes {self.nnodes}. Number the hosts 0 to {self.nnodes - 1}."
            )
        if self.nnodes > 1 and not self.port:
            raise ValueError(
                f"--master-addr must name node rank 0's address for a replica across "
                f"{self.nnodes} hosts: got none. Pass --master-addr HOST[:PORT] on every host."
            )
        return self


def rank_env(
    base: dict[str, str], rank: int, nproc: int, port: int, nodes: Nodes | None = None
) -> dict[str, str]:
    """torchrun's environment of local rank ``rank`` of ``nproc`` on this host, whose
    replica's store listens at ``nodes.master``, port ``port``."""
    nodes = nodes or Nodes()
    return {
        **base,
        "RANK": str(nodes.node_rank * nproc + rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nodes.nnodes * nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(nodes.node_rank),
        "GROUP_WORLD_SIZE": str(nodes.nnodes),
        "MASTER_ADDR": nodes.master,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


def rank_pids(launcher_pid: int) -> dict[int, int]:
    """The ranks a running launcher started: ``{RANK: pid}``, read from ``/proc``
    (for tools and tests that signal one rank): a forked rank's name, else a
    started one's environment."""
    out: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != launcher_pid:
                continue
            forked = rank_of(int(d))
            if forked is not None:
                out[forked] = int(d)
                continue
            env = Path(f"/proc/{d}/environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not ours to read
        for kv in env:
            if kv.startswith(b"RANK="):
                out[int(kv[5:])] = int(d)
    return out


def exit_status(code: int) -> int:
    """A ``Popen.returncode`` as a shell would report it (a signal ``S`` -> ``128 + S``)."""
    return 128 - code if code < 0 else code


def start_ranks(nproc: int, cmd: list[str], fork: bool, nodes: Nodes) -> tuple[list[Any], Any]:
    """Serve the replica's store (node rank 0 only) and start this host's ranks.
    Returns (ranks, what must stay referenced while they run: the store, or None)."""
    procs: list[Any]
    base = dict(os.environ)
    if nodes.node_rank > 0:  # the store is node 0's: the ranks here are its clients
        wait_for_master(nodes)
        env = [rank_env(base, r, nproc, nodes.port, nodes) for r in range(nproc)]
        if fork:
            return [fork_rank(cmd, e, []) for e in env], None
        return [subprocess.Popen(cmd, env=e, preexec_fn=die_with_parent) for e in env], None
    # One host: loopback, on a free port. Several: every interface (the other hosts
    # connect to nodes.master), on the port they were all given.
    bind = "" if nodes.nnodes > 1 else LOOPBACK
    if fork:
        # The store's socket listens before the ranks are forked (they connect to
        # it), and the store serves it once they are: no thread of its own is
        # running when this process forks.
        listener = listen(bind, nodes.port)
        port = listener.getsockname()[1]
        fds = [listener.fileno()]
        procs = [fork_rank(cmd, rank_env(base, r, nproc, port, nodes), fds) for r in range(nproc)]
        store = dist.TCPStore(
            LOOPBACK, port, is_master=True, wait_for_workers=False, use_libuv=True,
            master_listen_fd=listener.fileno(),
        )  # fmt: skip
        return procs, (listener, store)  # the store serves the listener's fd: keep both
    if nodes.port:  # a port taken is one line here, not the store's traceback
        listen(bind, nodes.port).close()
    store = dist.TCPStore(
        LOOPBACK, nodes.port, is_master=True, wait_for_workers=False, use_libuv=True
    )
    env = [rank_env(base, r, nproc, store.port, nodes) for r in range(nproc)]
    return [subprocess.Popen(cmd, env=e, preexec_fn=die_with_parent) for e in env], store


def listen(host: str, port: int) -> socket.socket:
    try:
        return socket.create_server((host, port), backlog=128)
    except OSError as e:
        raise SystemExit(
            f"phalanx ranks: the replica's store must listen on port {port} of node rank 0: "
            f"{e.strerror}. Pick another --master-addr port, or stop what holds it."
        ) from None


def wait_for_master(nodes: Nodes) -> None:
    """Wait until node rank 0's store answers; SystemExit in one line after
    ``nodes.timeout_s``."""
    addr = hostport(nodes.master, nodes.port)
    deadline = time.monotonic() + nodes.timeout_s
    while unreachable({"master": addr}, timeout_s=1.0):
        if time.monotonic() > deadline:
            raise SystemExit(
                f"phalanx ranks: the replica's node rank 0 must serve its store at {addr}: "
                f"nothing answered there in {nodes.timeout_s:g} s. Start the launcher with "
                f"--node-rank 0 on that host first, or fix --master-addr."
            )
        time.sleep(0.2)


def master_watch(nodes: Nodes) -> Callable[[], bool]:
    """A check, cheap to call in a loop, of whether node rank 0's store stopped
    answering (probed every :data:`WATCH_S`); always False on node 0."""
    if nodes.node_rank == 0:
        return lambda: False
    addr, next_at = hostport(nodes.master, nodes.port), [0.0]

    def gone() -> bool:
        if time.monotonic() < next_at[0]:
            return False
        next_at[0] = time.monotonic() + WATCH_S
        return bool(unreachable({"master": addr}, timeout_s=WATCH_S))

    return gone


def run(nproc: int, cmd: list[str], fork: bool = False, nodes: Nodes | None = None) -> int:
    nodes = nodes or Nodes()
    # The store (node 0's) serves as long as this frame holds it.
    procs, _store = start_ranks(nproc, cmd, fork, nodes)
    master_gone = master_watch(nodes)

    def forward(signum: int, frame: FrameType | None) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    failed: int | None = None
    deadline: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if failed is None and deadline is None and master_gone():
            # Node 0 finished (its ranks end with ours) or failed (ours fail at their
            # next collective): either way they end soon by themselves, unless node 0
            # went silent (a partition), for which there is the grace.
            print(
                f"phalanx ranks: the replica's node rank 0 (its store at "
                f"{hostport(nodes.master, nodes.port)}) is gone; this host's ranks get "
                f"{MASTER_GRACE_S:g} s to end",
                file=sys.stderr,
                flush=True,
            )
            deadline = time.monotonic() + MASTER_GRACE_S
        bad = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if bad and failed is None:
            failed = bad[0]
            print(
                f"phalanx ranks: rank {failed} exited with status "
                f"{exit_status(codes[failed] or 0)}; stopping the replica's other ranks",
                file=sys.stderr,
                flush=True,
            )
            for p in procs:
                if p.poll() is None:
                    p.kill()
        if all(c is not None for c in codes):
            break
        if codes[0] == 0 and deadline is None:
            deadline = time.monotonic() + EXIT_GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            print(
                "phalanx ranks: ranks still run past their grace (rank 0 finished, or node "
                "rank 0 is gone); stopping them",
                file=sys.stderr,
                flush=True,
            )
            for p in procs:
                if p.poll() is None:
                    p.kill()
            deadline = float("inf")
            failed = failed if failed is not None else -1
        time.sleep(0.02)
    for p in procs:
        p.wait()
    if failed is None:
        return 0
    if failed < 0:
        return 1
    return exit_status(procs[failed].returncode)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m phalanx.launch.ranks", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--nproc", type=int, required=True, help="ranks of the replica")
    ap.add_argument(
        "--fork",
        action="store_true",
        help="fork the ranks from this process (its imports done) instead of starting "
        "fresh interpreters; COMMAND must be this Python with -m MODULE or -c CODE",
    )
    ap.add_argument("--nnodes", type=int, default=1, help="hosts the replica spans (1)")
    ap.add_argument("--node-rank", type=int, default=0, help="this host's place, 0..nnodes-1")
    ap.add_argument(
        "--master-addr",
        metavar="HOST[:PORT]",
        help=f"node rank 0's address, which the other hosts reach, and its store's port "
        f"(default {DEFAULT_PORT}); needed with --nnodes > 1",
    )
    ap.add_argument(
        "--rdzv-timeout-s",
        type=float,
        default=300.0,
        help="how long a host other than node 0 waits for node 0's store (300 s)",
    )
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if args.nproc < 1 or not cmd:
        ap.error(f"--nproc must be >= 1 and a command must follow '--': got {args.nproc}, {cmd}")
    if args.fork and not forkable(cmd):
        ap.error(
            f"--fork runs a command of this Python ({sys.executable}) with -m MODULE or "
            f"-c CODE: got {cmd[:3]}; drop --fork to start it as a fresh process"
        )
    try:
        master, port = LOOPBACK, 0
        if args.master_addr:
            master, port = parse_hostport(args.master_addr, DEFAULT_PORT, "--master-addr")
        nodes = Nodes(args.nnodes, args.node_rank, master, port, args.rdzv_timeout_s).check()
    except ValueError as e:
        ap.error(str(e))
    return run(args.nproc, cmd, args.fork, nodes)


if __name__ == "__main__":
    sys.exit(main())

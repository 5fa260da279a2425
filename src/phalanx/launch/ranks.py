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
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch.distributed as dist

from phalanx.launch.procs import die_with_parent
from phalanx.launch.rank_forks import fork_rank, forkable, rank_of
from phalanx.net import LOOPBACK

EXIT_GRACE_S = 30.0
"""How long the other ranks get to exit once rank 0 has exited cleanly."""


def rank_env(base: dict[str, str], rank: int, nproc: int, port: int) -> dict[str, str]:
    return {
        **base,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(nproc),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
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


def run(nproc: int, cmd: list[str], fork: bool = False) -> int:
    procs: list[Any]
    if fork:
        # The store's socket listens before the ranks are forked (they connect to
        # it), and the store serves it once they are: no thread of its own is
        # running when this process forks.
        listener = socket.create_server((LOOPBACK, 0), backlog=128)
        port = listener.getsockname()[1]
        fds = [listener.fileno()]
        procs = [
            fork_rank(cmd, rank_env(dict(os.environ), r, nproc, port), fds) for r in range(nproc)
        ]
        store = dist.TCPStore(
            LOOPBACK, port, is_master=True, wait_for_workers=False, use_libuv=True,
            master_listen_fd=listener.fileno(),
        )  # fmt: skip
    else:
        store = dist.TCPStore(LOOPBACK, 0, is_master=True, wait_for_workers=False, use_libuv=True)
        procs = [
            subprocess.Popen(
                cmd,
                env=rank_env(dict(os.environ), r, nproc, store.port),
                preexec_fn=die_with_parent,
            )
            for r in range(nproc)
        ]

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
                f"phalanx ranks: rank 0 finished but others still run after {EXIT_GRACE_S} s; "
                "stopping them",
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
    return run(args.nproc, cmd, args.fork)


if __name__ == "__main__":
    sys.exit(main())

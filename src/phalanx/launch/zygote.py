"""A warm process that forks the launcher's replicas: the imports are paid once.

A replica's start is mostly imports (torch, transformers, the checkpointer,
datasets): seconds of CPU each, and several replicas starting at once on a
small machine share its cores. The launcher starts one **zygote** beside the
controller. It imports what the job's replicas need, then forks a replica on
each request, so a replica (the first ones, and every restart after a kill)
starts with its imports done. This is what DataLoader workers do on Linux:
fork a process that imported torch but started no work.

The wire is an ``AF_UNIX`` ``SOCK_SEQPACKET`` pair, one JSON object per
message, with file descriptors passed alongside (``SCM_RIGHTS``):

- launcher -> zygote: ``{"argv", "env", "cwd"}`` with the child's stdout and
  stderr, ``"module"`` when the child runs another module's ``main(argv)``
  than ``phalanx.cli``'s (a replica's ranks launcher, :mod:`phalanx.launch.
  ranks`), and ``"gid"`` when the child runs as a group of its own (its sockets
  carry it: :mod:`phalanx.launch.chaos.partition`); the zygote answers
  ``{"pid"}`` (or ``{"error"}``);
- zygote -> launcher: ``{"ready"}`` once the imports are done, and
  ``{"exit": pid, "rc": code}`` when a child ends (``rc`` as Popen gives it:
  ``-N`` for signal ``N``).

Each child starts a session of its own (its pid is its process group, which
the launcher signals), gets the default signal handlers, the request's
environment and working directory, fresh random seeds, and runs
``phalanx.cli.main(argv)`` (or the request's module's ``main``). The zygote
exits when the launcher's end closes; stopping the children stays the
launcher's job (by process group).
"""

from __future__ import annotations

import importlib
import json
import os
import random
import select
import signal
import socket
import sys
import time
from typing import Any

from phalanx.launch.procs import exit_as
from phalanx.launch.zygote_wire import MAX_MSG, send


def preload(modules: list[str]) -> list[str]:
    """Import ``modules`` (``pkg.mod`` or ``pkg.mod:attr``); returns those that failed,
    which the children then import themselves."""
    failed = []
    for spec in modules:
        name, _, attr = spec.partition(":")
        try:
            mod = importlib.import_module(name)
            if attr:
                getattr(mod, attr)  # a lazy module's attribute: imports what it names
        except Exception:
            failed.append(spec)
    return failed


def _child(sock: socket.socket, req: dict[str, Any], fds: list[int], started: int) -> None:
    """In the forked child: become the replica, and never return. ``started`` is
    closed once the child leads its own session, which the zygote waits for before
    it answers: a signal to the group the launcher is told of must reach it."""

    def become() -> int:
        sock.close()
        os.setsid()
        if req.get("gid") is not None:  # before any socket is opened: they carry it
            os.setgroups([])
            os.setgid(int(req["gid"]))
        os.close(started)
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(
                sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler
            )
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(fds[0], 1)
        os.dup2(fds[1], 2)
        for fd in {devnull, *fds} - {0, 1, 2}:
            os.close(fd)
        os.environ.clear()
        os.environ.update(req["env"])
        os.chdir(req["cwd"])
        random.seed()
        argv = [str(a) for a in req["argv"]]
        module = str(req.get("module") or "phalanx.cli")
        sys.argv = ["phalanx" if module == "phalanx.cli" else module, *argv]
        return int(importlib.import_module(module).main(argv))

    exit_as(become)


def serve(sock: socket.socket, modules: list[str]) -> None:
    """The zygote's loop: preload, say ready, fork on each request, report exits."""
    failed = preload(modules)
    sys.stdout.flush()
    sys.stderr.flush()
    send(sock, {"ready": True, "failed": failed})
    live: set[int] = set()
    while True:
        r, _, _ = select.select([sock], [], [], 0.05)
        for pid in list(live):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 0
            if done:
                live.discard(pid)
                rc = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
                send(sock, {"exit": pid, "rc": rc})
        if not r:
            continue
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_MSG, 4)
        except OSError:
            data, fds = b"", []
        if not data:
            return  # the launcher is gone: the children are its to stop
        try:
            req = json.loads(data)
            if not isinstance(req, dict) or len(fds) != 2:
                raise ValueError("a request is a JSON object with 2 file descriptors")
            sys.stdout.flush()
            sys.stderr.flush()
            ready_r, ready_w = os.pipe()
            pid = os.fork()
        except (ValueError, OSError) as e:
            for fd in fds:
                os.close(fd)
            send(sock, {"error": str(e)})
            continue
        if pid == 0:
            os.close(ready_r)
            _child(sock, req, fds, ready_w)
        os.close(ready_w)
        os.read(ready_r, 1)  # EOF: the child closed its end after setsid (or died)
        os.close(ready_r)
        for fd in fds:
            os.close(fd)
        live.add(pid)
        send(sock, {"pid": pid, "at": time.time()})


def main(argv: list[str]) -> int:
    """``python -m phalanx.launch.zygote FD MODULE...``: FD is the inherited socket."""
    sock = socket.socket(fileno=int(argv[0]))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher's Ctrl-C is for it to handle
    try:
        serve(sock, argv[1:])
    except (BrokenPipeError, ConnectionResetError):
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Ranks forked from their launcher rather than started as fresh interpreters
(``python -m phalanx.launch.ranks --fork``).

``phalanx run`` forks a replica's launcher from its zygote (:mod:`phalanx.launch.
zygote`), which imported torch and the job's loop already. With ``--fork`` the
launcher forks each rank in turn, so that every rank starts with its imports
done, as a single-process replica does: a restarted replica of N ranks does not
pay N interpreters' imports on cores its peers train on.

A forked rank runs the command as its interpreter would: ``python -m MODULE
ARGS`` through :func:`runpy.run_module`, ``python -c CODE ARGS`` through
``exec``, with torchrun's environment (:func:`~phalanx.launch.ranks.rank_env`),
the default SIGTERM and SIGINT handlers, fresh random seeds, and
``PR_SET_PDEATHSIG`` as a started rank has, and exits as its interpreter would
(:func:`~phalanx.launch.procs.exit_as`).

``/proc/PID/environ`` keeps the environment a process was started with, which a
forked rank never had of its own: its name (``/proc/PID/comm``) says its rank
instead (``phalanx-rank<N>``; :func:`rank_of`)."""

from __future__ import annotations

import ctypes
import os
import random
import runpy
import signal
import sys
from pathlib import Path

from phalanx.launch.procs import die_with_parent, exit_as

PR_SET_NAME = 15
NAME = "phalanx-rank"


def forkable(cmd: list[str]) -> bool:
    """Whether a forked rank can run ``cmd``: this interpreter with ``-m MODULE`` or
    ``-c CODE``."""
    return len(cmd) >= 3 and cmd[0] == sys.executable and cmd[1] in ("-m", "-c")


def rank_of(pid: int) -> int | None:
    """The rank a forked rank's name gives, or None (not a forked rank, or gone)."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return None
    tail = comm.removeprefix(NAME)
    return int(tail) if tail != comm and tail.isdigit() else None


class ForkedRank:
    """A rank forked from this process, with the part of ``Popen``'s interface
    :func:`phalanx.launch.ranks.run` uses."""

    def __init__(self, pid: int):
        self.pid = pid
        self.returncode: int | None = None

    def _reap(self, flags: int) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, flags)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        return self._reap(os.WNOHANG)

    def wait(self) -> int:
        rc = self._reap(0)
        assert rc is not None
        return rc

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def fork_rank(cmd: list[str], env: dict[str, str], close: list[int]) -> ForkedRank:
    """Fork one rank that runs ``cmd`` (:func:`forkable`) with ``env``; the child
    closes the file descriptors ``close`` (the launcher's own: its store's)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return ForkedRank(pid)

    def become() -> int:
        for fd in close:
            os.close(fd)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        die_with_parent()
        name = f"{NAME}{env.get('RANK', '')}".encode()
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_NAME, name)
        except OSError:
            pass  # not glibc: tools find this rank by its parent alone
        os.environ.clear()
        os.environ.update(env)
        random.seed()
        flag, target, *args = cmd[1:]
        if flag == "-m":
            sys.argv = [target, *args]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *args]
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
        return 0

    exit_as(become)

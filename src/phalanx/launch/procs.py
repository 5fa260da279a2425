"""Child processes of a launcher or an agent: each started in a session (process
group) of its own, and signalled and stopped by that group, never by name."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import IO, NoReturn, Protocol


class Proc(Protocol):
    """A child replica: a ``Popen``, or one forked by the zygote
    (:class:`phalanx.launch.forks.ForkedProc`)."""

    @property
    def pid(self) -> int: ...

    @property
    def stdout(self) -> IO[bytes] | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user's counts: signalling it is
    refused, not unknown)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In a child, before exec (``preexec_fn``): SIGKILL it when the thread that
    started it dies (its launcher, a Ray actor's worker that lost its node)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not glibc: a launcher killed alone leaves its child to its timeouts


def exit_as(body: Callable[[], int]) -> NoReturn:
    """In a forked child: run ``body`` and end the process with its exit code as an
    interpreter would (a ``SystemExit``'s code, its message on stderr; 1 and the
    traceback for any other exception), the output flushed and no cleanup run
    (``os._exit``: the parent's threads and objects are not this process's)."""
    rc = 1
    try:
        rc = body()
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        for f in (sys.stdout, sys.stderr):
            try:
                f.flush()
            except Exception:
                pass
        os._exit(rc & 0xFF)


def spawn(
    cmd: list[str], log: Path, stdout: int | None = None, gid: int | None = None
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a new session, its stderr (and stdout, unless given) appended
    to ``log``; with ``gid`` (root only), as that group alone (no supplementary
    groups), so that its sockets carry it (:mod:`phalanx.launch.chaos.partition`)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with log.open("ab") as f:
        return subprocess.Popen(
            cmd,
            stdout=stdout if stdout is not None else f,
            stderr=f,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
            group=gid,
            extra_groups=None if gid is None else [],
        )


def last_line(log: Path, default: str = "") -> str:
    """The last non-empty line of a child's log (its one-line error, when it failed)."""
    try:
        with log.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = [x.strip() for x in f.read().decode(errors="replace").splitlines()]
    except OSError:
        return default
    return next((x for x in reversed(lines) if x), default)


def signal_group(pgid: int, sig: int) -> None:
    """Send ``sig`` to a process group; one already gone is not an error."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def signal_proc(proc: Proc | None, sig: int) -> None:
    """Send ``sig`` to a live child's process group; a child on another host (a Ray
    actor's, :class:`phalanx.launch.ray_job.RayProc`) delivers it itself."""
    if proc is not None and proc.poll() is None:
        deliver = getattr(proc, "deliver", None)
        if deliver is not None:
            deliver(sig)
        else:
            signal_group(proc.pid, sig)


def stop_all(procs: list[Proc | None], grace_s: float = 5.0) -> None:
    """SIGTERM each process group, then SIGKILL those still alive after ``grace_s``."""
    live = [p for p in procs if p is not None and p.poll() is None]
    for p in live:
        signal_proc(p, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_proc(p, signal.SIGKILL)
            p.wait()

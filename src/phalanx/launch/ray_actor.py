"""What runs inside a Ray worker for one replica (:class:`ReplicaActor`): the
replica's program, ``phalanx <argv>``, with its output captured line by line
for the driver (:mod:`phalanx.launch.ray_executor`).

Two ways to run it:

- :meth:`ReplicaActor.run`: in the worker process itself (``runpy``), as
  decoupled DiLoCo slots do;
- :meth:`ReplicaActor.spawn`: as a child process of the worker, in a process
  group of its own, so that the driver can signal it (a scale-down's SIGTERM,
  which drains an RL replica) and a replica of N ranks runs under
  :mod:`phalanx.launch.ranks`. The child dies with the worker
  (``PR_SET_PDEATHSIG``): when Ray kills the actor or its node goes, nothing
  is left running that the job cannot see.
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from phalanx import env as phalanx_env
from phalanx.launch.procs import die_with_parent, signal_group


def run_cli(argv: list[str]) -> int:
    """``phalanx <argv>`` in this process, as ``python -m phalanx <argv>`` runs it
    (``runpy``: the executor runs the program it is given, it does not import the
    CLI), with the exit code that would have: ``SystemExit`` becomes its code (a
    message goes to stderr, code 1), an uncaught exception prints its traceback
    and gives 1."""
    saved = sys.argv
    sys.argv = ["phalanx", *argv]
    try:
        runpy.run_module("phalanx", run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.argv = saved
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass


class ReplicaActor:
    """The actor (made remote by :class:`RayExecutor`): runs one replica in its
    worker process, then nothing else. ``run`` is called once; ``ready`` and
    ``logs`` may be called at any time, concurrently with it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lines: list[str] = []
        self._base = 0
        """Line number of ``_lines[0]``: lines before it were pulled, and dropped."""
        self._partial = b""
        self._done = False
        self._started_at = time.time()
        self._child: subprocess.Popen[bytes] | None = None
        self._signalled: int | None = None
        """A signal sent before the child started: it gets it as it starts."""

    def ready(self) -> dict[str, Any]:
        """When the actor started (wall clock), its worker's pid, and its node's IP
        and id (plain values: they cross to the driver)."""
        import ray

        ctx = ray.get_runtime_context()
        return {
            "started_at": self._started_at,
            "pid": os.getpid(),
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ctx.get_node_id(),
        }

    def logs(self, since: int) -> tuple[list[str], int, bool]:
        """Lines from ``since`` on, the next cursor, and whether the run ended with
        every line read. Lines before ``since`` are dropped: the caller has them."""
        with self._lock:
            drop = min(max(since - self._base, 0), len(self._lines))
            del self._lines[:drop]
            self._base += drop
            return list(self._lines), self._base + len(self._lines), self._done

    def _read(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            with self._lock:
                if not data:
                    if self._partial:
                        self._lines.append(self._partial.decode("utf-8", "replace"))
                        self._partial = b""
                    break
                *complete, self._partial = (self._partial + data).split(b"\n")
                self._lines += [ln.decode("utf-8", "replace").rstrip("\r") for ln in complete]
        os.close(fd)

    def _reader(self) -> tuple[int, threading.Thread]:
        """A pipe whose lines become the replica's log; returns its write end."""
        r, w = os.pipe()
        reader = threading.Thread(target=self._read, args=(r,), daemon=True, name="replica-logs")
        reader.start()
        return w, reader

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str | None, ranks: int) -> int:
        """Run ``python -m phalanx <argv>`` as a child (under :mod:`phalanx.launch.ranks`
        when ``ranks`` > 1) and return its exit code (a Popen returncode: ``-S`` for
        a signal). Unless the node's environment names one, the child advertises
        this node's IP (:data:`phalanx.env.ADVERTISE_HOST`), which Ray's nodes
        reach each other at."""
        import ray

        cmd = [sys.executable, "-m", "phalanx", *argv]
        if ranks > 1:
            cmd = [sys.executable, "-m", "phalanx.launch.ranks", "--nproc", str(ranks), "--", *cmd]
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
        if not os.environ.get(phalanx_env.ADVERTISE_HOST):
            child_env[phalanx_env.ADVERTISE_HOST] = ray.util.get_node_ip_address()
        w, reader = self._reader()
        try:
            with self._lock:
                self._child = subprocess.Popen(
                    cmd,
                    stdout=w,
                    stderr=w,
                    stdin=subprocess.DEVNULL,
                    cwd=cwd,
                    env=child_env,
                    start_new_session=True,  # signal() reaches its whole group
                    preexec_fn=die_with_parent,  # dies with this thread's process
                )
                if self._signalled is not None:
                    signal_group(self._child.pid, self._signalled)
        except OSError as e:
            why = f"replica must start on the actor's node: {cmd[:4]} in cwd {cwd!r}: {e}\n"
            os.write(w, why.encode())
            return 1
        finally:
            os.close(w)
        code = self._child.wait()
        # Ranks or helpers it left in its group go with it (the group id cannot be
        # reused while any member lives).
        signal_group(self._child.pid, signal.SIGKILL)
        reader.join(timeout=5.0)
        with self._lock:
            self._done = True
        return code

    def signal(self, sig: int) -> bool:
        """Send ``sig`` to the spawned child's process group (to the child as it
        starts, when it has not yet); False when it ended."""
        with self._lock:
            child = self._child
            if child is None:
                self._signalled = sig
                return True
        if child.poll() is not None:
            return False
        signal_group(child.pid, sig)
        return True

    def run(self, argv: list[str], env: dict[str, str], cwd: str | None) -> int:
        os.environ.update(env)
        w, reader = self._reader()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.close(w)
        try:
            if cwd is not None:
                os.chdir(cwd)  # inside the capture: a bad cwd is this replica's failure
            return run_cli(argv)
        except OSError as e:
            print(
                f"replica cwd must be a directory on the actor's node: got {cwd!r} ({e}).",
                file=sys.stderr,
            )
            return 1
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            # EOF comes once no process holds the pipe; children the command left
            # running still may, so do not wait for them.
            reader.join(timeout=5.0)
            with self._lock:
                self._done = True

"""The embedded default executor: each replica is a local process,
``python -m phalanx <argv>``, in its own process group (its own session), with
stdout and stderr appended to ``log_dir/<name>.log``.

A replica is stopped by signalling its process group (SIGTERM, then SIGKILL
after a grace), found by the pid the executor started; nothing is ever killed
by name. All replicas share this host, so they can reach each other over the
network (``supports_inter_replica_network = True``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from array import array
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from phalanx.launch.base import (
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
    ServerlessExecutor,
    check_launch,
    describe_exit,
)
from phalanx.launch.procs import signal_group

__all__ = ["LocalProcessExecutor"]


class LogFile:
    """Line-indexed view of a log file that another process appends to.

    Keeps the byte offset past each complete line, so that reading from line N
    seeks there instead of rereading the file. Not thread-safe (the executor's
    lock guards it)."""

    def __init__(self, path: Path):
        self.path = path
        self.ends = array("q")
        """Byte offset just past the ``\\n`` of each complete line seen so far."""

    def _scan(self) -> None:
        start = self.ends[-1] if self.ends else 0
        try:
            with self.path.open("rb") as f:
                f.seek(start)
                data = f.read()
        except FileNotFoundError:
            return
        i = data.find(b"\n")
        while i >= 0:
            self.ends.append(start + i + 1)
            i = data.find(b"\n", i + 1)

    def read(self, since: int) -> tuple[list[str], int]:
        """Complete lines from line ``since`` on, and the next cursor."""
        if since < 0:
            raise ValueError(f"log cursor must be >= 0: got {since}.")
        self._scan()
        n = len(self.ends)
        if since >= n:
            return [], n
        begin = self.ends[since - 1] if since else 0
        with self.path.open("rb") as f:
            f.seek(begin)
            data = f.read(self.ends[-1] - begin)
        lines = data.split(b"\n")[:-1]
        return [ln.decode("utf-8", "replace").rstrip("\r") for ln in lines], n

    def seal(self) -> None:
        """End a partial last line, once its writer exited, so that it counts."""
        try:
            with self.path.open("rb+") as f:
                size = f.seek(0, os.SEEK_END)
                if size:
                    f.seek(size - 1)
                    if f.read(1) != b"\n":
                        f.write(b"\n")
        except FileNotFoundError:
            pass


@dataclass
class _Run:
    """One launch of a replica name."""

    spec: ReplicaSpec
    attempt: int
    proc: subprocess.Popen[bytes]
    started_at: float
    state: ReplicaState = ReplicaState.RUNNING
    ended_at: float | None = None
    exit_code: int | None = None
    error: str | None = None
    cancelling: bool = False
    """The executor sent SIGTERM: however it exits now, it was cancelled."""

    def status(self) -> ReplicaStatus:
        return ReplicaStatus(
            self.spec.name,
            self.state,
            self.exit_code,
            self.started_at,
            self.ended_at,
            self.error,
            self.attempt,
        )


class LocalProcessExecutor(ServerlessExecutor):
    """Replicas as local processes; see the module doc.

    ``log_dir`` gets one ``<name>.log`` per replica name (relaunches append to
    it, after a ``--- relaunch N of NAME ---`` line); give each executor its own.
    ``python`` is the interpreter that runs ``-m phalanx``; it must import the
    same phalanx. A spec's ``cwd=None`` runs in this process's working directory.
    ``grace_s`` is how long :meth:`cancel` waits between SIGTERM and SIGKILL.
    Replicas get this process's environment, ``PYTHONUNBUFFERED=1`` (so that
    their output reaches the log as it is written) and the spec's ``env``."""

    backend_name = "local"
    supports_inter_replica_network = True

    def __init__(self, log_dir: Path | str, python: str = sys.executable, grace_s: float = 10.0):
        if grace_s < 0:
            raise ValueError(f"grace_s must be >= 0: got {grace_s}.")
        self.log_dir = Path(log_dir).absolute()
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.python = python
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}
        self._logs: dict[str, LogFile] = {}
        self._closed = False

    # -- launching ------------------------------------------------------

    def log_path(self, name: str) -> Path:
        """Where the replica's output goes (``log_dir/<name>.log``)."""
        return self.log_dir / f"{name}.log"

    def launch_replicas(self, specs: Iterable[ReplicaSpec]) -> list[str]:
        """See :meth:`ServerlessExecutor.launch_replicas`. All or nothing: when a
        process cannot be started (``OSError``: a missing ``cwd``, a bad
        ``python``), those this call already started are killed again and the
        error is raised."""
        specs = list(specs)
        with self._lock:
            if self._closed:
                raise RuntimeError("local executor must be open to launch replicas: it is closed.")
            self._refresh()
            check_launch(specs, [n for n, r in self._runs.items() if not r.state.ended])
            before = {s.name: self._runs.get(s.name) for s in specs}
            try:
                for s in specs:
                    self._runs[s.name] = self._start(s, before[s.name])
            except OSError as e:
                for s in specs:
                    run, old = self._runs.get(s.name), before[s.name]
                    if run is not None and run is not old:
                        signal_group(run.proc.pid, signal.SIGKILL)
                        run.proc.wait()
                    if old is None:
                        self._runs.pop(s.name, None)
                        self._logs.pop(s.name, None)
                    else:
                        self._runs[s.name] = old
                raise OSError(
                    e.errno,
                    f"local executor could not start replica processes ({e}); started none "
                    f"of {[s.name for s in specs]}. Check the spec's cwd and the python "
                    f"{self.python!r}.",
                ) from e
        return [s.name for s in specs]

    def _start(self, spec: ReplicaSpec, previous: _Run | None) -> _Run:
        attempt = 0 if previous is None else previous.attempt + 1
        log = self._logs.setdefault(spec.name, LogFile(self.log_path(spec.name)))
        if attempt:
            log.seal()
            with log.path.open("ab") as f:
                f.write(f"--- relaunch {attempt} of {spec.name} ---\n".encode())
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **spec.env}
        with log.path.open("ab") as f:
            cmd = [self.python, "-m", "phalanx", *spec.argv]
            if spec.ranks > 1:
                cmd = [
                    self.python,
                    "-m",
                    "phalanx.launch.ranks",
                    "--nproc",
                    str(spec.ranks),
                    "--",
                    *cmd,
                ]
            proc = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=spec.cwd,
                env=env,
                # Its own session and process group: a signal to ours does not reach
                # it, and cancel() reaches its children through the group.
                start_new_session=True,
            )
        return _Run(spec, attempt, proc, time.time())

    # -- watching -------------------------------------------------------

    def _refresh(self) -> None:
        """Record the end of every replica whose process exited (lock held)."""
        for run in self._runs.values():
            if run.state.ended:
                continue
            code = run.proc.poll()
            if code is None:
                continue
            run.exit_code, run.ended_at = code, time.time()
            if run.cancelling:
                run.state, run.error = ReplicaState.CANCELLED, f"cancelled; {describe_exit(code)}"
            elif code == 0:
                run.state = ReplicaState.SUCCEEDED
            else:
                run.state, run.error = ReplicaState.FAILED, describe_exit(code)
            self._logs[run.spec.name].seal()

    def poll(self) -> dict[str, ReplicaStatus]:
        with self._lock:
            self._refresh()
            return {n: r.status() for n, r in self._runs.items()}

    def pid(self, name: str) -> int:
        """The pid (and process group id) of the latest launch of ``name``. Signal it
        only while the replica runs: once it ended, the pid may be reused."""
        with self._lock:
            return self._runs[name].proc.pid

    def spec(self, name: str) -> ReplicaSpec:
        with self._lock:
            return self._runs[name].spec

    def stream_logs(self, name: str, since: int = 0) -> tuple[list[str], int]:
        with self._lock:
            if name not in self._logs:
                raise KeyError(f"replica {name!r} was never launched on this executor")
            self._refresh()
            return self._logs[name].read(since)

    # -- stopping -------------------------------------------------------

    def cancel(self, name: str | None = None) -> None:
        with self._lock:
            if name is not None and name not in self._runs:
                raise KeyError(f"replica {name!r} was never launched on this executor")
            self._refresh()
            runs = list(self._runs.values()) if name is None else [self._runs[name]]
            targets = [r for r in runs if not r.state.ended and r.proc.poll() is None]
            for r in targets:
                r.cancelling = True
                signal_group(r.proc.pid, signal.SIGTERM)
        # Wait without the lock, so that poll() answers meanwhile.
        deadline = time.monotonic() + self.grace_s
        for r in targets:
            try:
                r.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # Also after a clean exit of the leader: children it left in its group
            # must go too. The group id cannot be reused while any member lives.
            signal_group(r.proc.pid, signal.SIGKILL)
            r.proc.wait()
        with self._lock:
            self._refresh()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.cancel()

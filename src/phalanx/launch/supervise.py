"""A job's controller as a supervised child process (``phalanx run``, and ``phalanx
agent --serve-controller``).

The controller comes back from its own SIGKILL with nothing lost: its state
dir holds the journal, the payload log, the token and its URL, and replicas
re-attach by themselves (DESIGN.md, control plane). That only helps if
something starts it again. :class:`ControllerProcess` does: when the
controller exits while the job runs, it is started again at once on the same
state dir, on the same port (a controller started with ``--port 0`` takes the
port of its state dir's ``url`` file when it is free), so that replicas that
only know the URL find it where it was. A controller that exits
``max_failed_starts`` times in a row before it answers (a damaged journal, a
bad config) is not started again: that is an error to report, not to hide.
Nor is a controller whose TLS certificate this launcher cannot verify (it
would never answer): that stops the launcher at once, in one line.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx

from phalanx.client.transport import ControllerError, certificate_mismatch, verify_context
from phalanx.launch.procs import spawn, stop_all

MAX_FAILED_STARTS = 3
START_TIMEOUT_S = 60.0
"""Longest a (re)started controller may take to answer ``/healthz``."""


class ControllerDown(RuntimeError):
    """The controller cannot be (re)started."""


class ControllerProcess:
    """Who calls: one launcher (or agent) thread; not thread-safe."""

    def __init__(
        self,
        state_dir: Path,
        args: list[str],
        log: Path,
        *,
        host: str | None = None,
        port: int | None = None,
        tls: tuple[str, str] | None = None,
        max_failed_starts: int = MAX_FAILED_STARTS,
    ):
        self.state_dir, self.args, self.log = state_dir, args, log
        self.host, self.port = host, port
        self.tls = tls
        """(certificate, key) PEM files: the controller serves HTTPS."""
        self.max_failed_starts = max_failed_starts
        self.proc: subprocess.Popen[bytes] | None = None
        self.url: str | None = None
        self.restarts = 0
        self.failed_starts = 0
        self._up = False
        self._started_at = 0.0

    @property
    def target(self) -> str:
        """What replicas are given as ``--controller``: the state dir, whose ``url``
        they re-read when the controller comes back on another port."""
        return str(self.state_dir)

    @property
    def url_file(self) -> Path:
        return self.state_dir / "url"

    def _cmd(self) -> list[str]:
        cmd = [
            sys.executable,
            "-m",
            "phalanx.cli",
            "controller",
            "--state-dir",
            str(self.state_dir),
        ]
        if self.host is not None:
            cmd += ["--host", self.host]
        if self.port is not None:
            cmd += ["--port", str(self.port)]
        if self.tls is not None:
            cmd += ["--tls-cert", self.tls[0], "--tls-key", self.tls[1]]
        return [*cmd, *self.args]

    def _spawn(self) -> None:
        self.proc = spawn(self._cmd(), self.log)
        self._up = False
        self._started_at = time.monotonic()

    def start(self) -> str:
        """Start the controller and wait until it answers; returns its URL. Raises
        :class:`ControllerDown` (with its log's path) if it does not come up."""
        self.url_file.unlink(missing_ok=True)  # a fresh start publishes its own
        self._spawn()
        while not self._came_up():
            if self.proc is not None and self.proc.poll() is not None:
                raise ControllerDown(
                    f"controller exited with {self.proc.returncode} at its start; see {self.log}"
                )
            if time.monotonic() - self._started_at > START_TIMEOUT_S:
                raise ControllerDown(
                    f"controller did not answer within {START_TIMEOUT_S:.0f} s; see {self.log}"
                )
            time.sleep(0.05)
        return self.url or ""

    def _came_up(self) -> bool:
        """Whether the running controller published its URL and answers there."""
        if self._up:
            return True
        lock = self.state_dir / "controller.lock"
        try:
            # The lock names the holder's pid and URL once it listens (server.py).
            note = lock.read_text().split()
        except OSError:
            return False
        if self.proc is None or len(note) < 4 or note[1] != str(self.proc.pid):
            return False
        try:
            verify = verify_context()
        except ControllerError as e:
            raise ControllerDown(str(e)) from None
        try:
            httpx.get(f"{note[3]}/healthz", timeout=2.0, verify=verify).raise_for_status()
        except httpx.HTTPError as e:
            mismatch = certificate_mismatch(note[3], e)
            if mismatch is not None:
                raise ControllerDown(str(mismatch)) from None
            return False
        self.url, self._up, self.failed_starts = note[3], True, 0
        return True

    def check(self) -> str | None:
        """Call often. Restarts a controller that exited; returns a line for the
        operator when something happened (None otherwise). Raises
        :class:`ControllerDown` once it keeps failing to start."""
        if self.proc is None:
            return None
        code = self.proc.poll()
        if code is None:
            if not self._up and self._came_up():
                return f"controller back at {self.url} (restart {self.restarts})"
            if not self._up and time.monotonic() - self._started_at > START_TIMEOUT_S:
                stop_all([self.proc])
                return self._failed(f"did not answer within {START_TIMEOUT_S:.0f} s")
            return None
        if not self._up:
            return self._failed(f"exited with {code} before it answered")
        self.restarts += 1
        self._spawn()  # the same state dir; the port of its url file
        return f"controller exited with {code}; restarting it on {self.state_dir}"

    def _failed(self, why: str) -> str:
        self.failed_starts += 1
        if self.failed_starts >= self.max_failed_starts:
            raise ControllerDown(
                f"controller {why}, {self.failed_starts} times in a row; see {self.log}"
            )
        self._spawn()
        return f"controller {why}; starting it again ({self.failed_starts})"

    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def up(self) -> bool:
        """It runs, and has answered since its latest start."""
        return self._up and self.proc is not None and self.proc.poll() is None

    def members(self) -> list[ControllerProcess]:
        """This one controller (the interface of a group: :class:`Controllers`)."""
        return [self]

    def poll(self) -> int | None:
        """The exit code of the controller process started last (None: running, or
        never started)."""
        return self.proc.poll() if self.proc is not None else None

    def stop(self) -> None:
        stop_all([self.proc])

"""The launcher's side of the zygote (:mod:`phalanx.launch.zygote`): start it,
ask it for replicas, and hold each forked replica as a Popen-like handle.

A forked replica is the zygote's child, not the launcher's: its exit status
comes over the zygote's socket. If the zygote dies, :class:`Zygote` stops
taking requests (the launcher falls back to plain ``Popen``), and the handles
of its children tell liveness by signal 0 (an exit code of -1 when one is
gone, as nothing reaped it for us).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from phalanx.launch.zygote_wire import MAX_MSG, send

log = logging.getLogger("phalanx.launch")

UNKNOWN_EXIT = -1
"""The exit code of a forked child whose zygote died before reporting it."""


class ForkedProc:
    """A replica forked by the zygote, with the part of ``Popen``'s interface the
    launcher uses: ``pid``, ``stdout``, ``returncode``, ``poll``, ``wait``."""

    def __init__(self, zygote: Zygote, pid: int, stdout: IO[bytes] | None):
        self.zygote, self.pid, self.stdout = zygote, pid, stdout
        self.returncode: int | None = None
        self._exited = threading.Event()

    def _exit(self, rc: int) -> None:
        self.returncode = rc
        self._exited.set()

    def poll(self) -> int | None:
        if self.returncode is None and self.zygote.dead:
            try:
                os.kill(self.pid, 0)  # the zygote is gone: nobody reports this exit
            except ProcessLookupError:
                self._exit(UNKNOWN_EXIT)
            except PermissionError:
                pass
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0.0)
            self._exited.wait(0.1 if left is None else min(0.1, left))
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """One zygote process preloading ``modules``; its own output goes to ``log``."""

    def __init__(self, modules: list[str], log_path: Path):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        with log_path.open("ab") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "phalanx.launch.zygote", str(theirs.fileno()), *modules],
                stdout=f,
                stderr=f,
                stdin=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                start_new_session=True,
                env=env,
            )
        theirs.close()
        self.sock = ours
        self.dead = False
        self.failed: list[str] = []
        """Modules the zygote could not preload (the children import them)."""
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._reply: dict[str, Any] | None = None
        self._replied = threading.Condition()
        self._children: dict[int, ForkedProc] = {}
        self._early: dict[int, int] = {}
        """Exits reported before their handle was made (a child that died at once)."""
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(MAX_MSG)
            except OSError:
                data = b""
            if not data:
                break
            msg = json.loads(data)
            if "ready" in msg:
                self.failed = list(msg.get("failed", []))
                self._ready.set()
            elif "exit" in msg:
                with self._replied:
                    child = self._children.pop(msg["exit"], None)
                    if child is None:
                        self._early[msg["exit"]] = msg["rc"]
                if child is not None:
                    child._exit(msg["rc"])
            else:
                with self._replied:
                    self._reply = msg
                    self._replied.notify_all()
        self.dead = True
        self._ready.set()
        with self._replied:
            self._replied.notify_all()

    def ready(self, timeout: float) -> bool:
        """Wait until the zygote finished its imports (False: it died or is too slow)."""
        return self._ready.wait(timeout) and not self.dead

    def spawn(
        self,
        argv: list[str],
        log_path: Path,
        pipe_stdout: bool,
        module: str = "phalanx.cli",
        gid: int | None = None,
    ) -> ForkedProc | None:
        """Fork ``phalanx ARGV`` (``module``'s ``main(argv)``) with stderr (and stdout,
        unless ``pipe_stdout``: then a pipe, read from the handle's ``stdout``) appended
        to ``log_path``; with ``gid``, as that group alone. None: the zygote cannot
        (dead, or not ready in time); start the replica another way."""
        if not self.ready(120.0):
            return None
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        req = {"argv": argv, "env": env, "cwd": os.getcwd(), "module": module, "gid": gid}
        r = w = None
        with log_path.open("ab") as f:
            if pipe_stdout:
                r, w = os.pipe()
            fds = [w if w is not None else f.fileno(), f.fileno()]
            with self._lock:
                with self._replied:
                    self._reply = None
                try:
                    send(self.sock, req, fds)
                except OSError:
                    reply: dict[str, Any] | None = None
                else:
                    with self._replied:
                        self._replied.wait_for(lambda: self._reply is not None or self.dead, 30)
                        reply = self._reply
        if w is not None:
            os.close(w)
        if reply is None or "pid" not in reply:
            if r is not None:
                os.close(r)
            if reply is not None:
                log.warning("the zygote could not fork %s: %s", argv[:3], reply.get("error"))
            return None
        proc = ForkedProc(self, int(reply["pid"]), os.fdopen(r, "rb") if r is not None else None)
        with self._replied:
            early = self._early.pop(proc.pid, None)
            if early is None:
                self._children[proc.pid] = proc
        if early is not None:
            proc._exit(early)
        return proc

    def close(self) -> None:
        """Stop the zygote (its children are the launcher's to stop, by group)."""
        try:
            self.sock.close()
        except OSError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def preload_for(cfg: Any, roles: set[str]) -> list[str]:
    """What the zygote imports for a job's replicas of ``roles``: each role's process
    loop and, in an RL job, the transformers classes and the model's own module."""
    from phalanx.jobs import JOBS, job_kind

    mods = sorted({JOBS[job_kind(cfg, role)].module for role in roles})
    if cfg.replica.ranks > 1:
        mods.append("phalanx.launch.ranks")  # forks the ranks of a replica (--fork)
    if cfg.rl is not None:
        mods += ["transformers:AutoModelForCausalLM", "transformers:AutoTokenizer"]
        kind = cfg.rl.model.arch
        if cfg.rl.model.path:
            try:
                with open(Path(cfg.rl.model.path) / "config.json") as f:
                    kind = str(json.load(f).get("model_type", kind))
            except (OSError, ValueError):
                pass  # the replica says what is wrong with the model, in one line
        if kind.isidentifier():
            mods.append(f"transformers.models.{kind}.modeling_{kind}")
    return mods

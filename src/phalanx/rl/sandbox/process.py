"""The host side of one sandboxed run: start the command in its own process group,
read its output under a deadline and a byte cap, kill the whole group when either is
crossed, and turn whatever happened into a :class:`~.base.RunResult`.

Nothing here raises for what the child does. The kill is ``SIGKILL`` to the process
group of the command the host started (bubblewrap's monitor); the sandbox's own
processes live in a pid namespace whose init dies with that monitor, which makes the
kernel kill every process left in the namespace. The host then reads the pipes to EOF:
every sandboxed process holds them, so EOF means they are all gone.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import IO

from phalanx.rl.sandbox.base import Reason, RunResult, SandboxLimits

REAP_S = 5.0
"""How long the host waits, after its kill, for the sandbox's pipes to close (the
kernel is tearing down the pid namespace) before it gives up on the leftovers."""

_MEMORY = re.compile(
    rb"^(MemoryError\b|.*Cannot allocate memory|Fatal Python error: .*memory)", re.M | re.I
)
"""A traceback ending in ``MemoryError`` (Python's report of a refused allocation under
``RLIMIT_AS``), or a C-level allocation failure (ENOMEM, an interpreter that could not
allocate while starting)."""


class _Stream:
    """One pipe: keep its head (stdout) or its tail (stderr), count every byte."""

    def __init__(self, keep: int, tail: bool) -> None:
        self.keep, self.tail = keep, tail
        self.buf = bytearray()
        self.total = 0

    def add(self, chunk: bytes) -> None:
        self.total += len(chunk)
        if self.tail:
            self.buf += chunk
            if len(self.buf) > 2 * self.keep:
                del self.buf[: len(self.buf) - self.keep]
        elif len(self.buf) < self.keep:
            self.buf += chunk[: self.keep - len(self.buf)]

    def text(self) -> str:
        kept = bytes(self.buf[-self.keep :] if self.tail else self.buf[: self.keep])
        out = kept.decode("utf-8", errors="replace")
        cut = self.total - len(kept)
        if cut <= 0:
            return out
        if self.tail:
            return f"[... {cut} bytes cut ...]\n{out}"
        return f"{out}\n[... {cut} more bytes cut ...]"


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # it exited between the check and the kill
        pass


def run_limited(
    cmd: Sequence[str], *, stdin: IO[bytes], limits: SandboxLimits, start: float
) -> RunResult:
    """Run ``cmd`` (a sandbox launcher) and return its result; ``start`` is the
    ``time.monotonic()`` the run's wall clock counts from."""
    proc = subprocess.Popen(
        list(cmd),
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    pipe_out, pipe_err = proc.stdout, proc.stderr
    if pipe_out is None or pipe_err is None:  # cannot happen: both are PIPE
        raise RuntimeError("sandbox pipes missing")
    out = _Stream(limits.keep_bytes, tail=False)
    err = _Stream(limits.keep_bytes, tail=True)
    streams = {pipe_out.fileno(): out, pipe_err.fileno(): err}
    deadline = start + limits.time_s
    reason: Reason | None = None
    with selectors.DefaultSelector() as sel:
        for fd in streams:
            os.set_blocking(fd, False)
            sel.register(fd, selectors.EVENT_READ)
        reason = _pump(sel, streams, proc, deadline, limits.max_output_bytes)
        if reason is None:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:  # closed its pipes, kept running
                reason = "timeout"
                _kill_group(proc)
        if reason is not None:
            # Drain until every sandboxed process has let go of the pipes; the bytes
            # still count for the cut notes but cannot change the verdict.
            _pump(sel, streams, proc, time.monotonic() + REAP_S, None)
    proc.wait()
    pipe_out.close()
    pipe_err.close()
    rc = None if reason is not None else proc.returncode
    if reason is None:
        if rc == 0:
            reason = "ok"
        elif _MEMORY.search(bytes(err.buf[-4096:])):
            reason = "memory"
        else:
            reason = "error"
    return RunResult(
        reason=reason,
        exit_code=rc,
        stdout=out.text(),
        stderr=err.text(),
        wall_ms=(time.monotonic() - start) * 1000.0,
    )


def _pump(
    sel: selectors.BaseSelector,
    streams: dict[int, _Stream],
    proc: subprocess.Popen[bytes],
    deadline: float,
    cap: int | None,
) -> Reason | None:
    """Read the pipes until both reach EOF (None), the deadline passes ("timeout") or,
    when ``cap`` is given, more than ``cap`` bytes have come ("output"). A crossed
    limit kills the process group before returning."""
    while sel.get_map():
        left = deadline - time.monotonic()
        if left <= 0:
            if cap is not None:
                _kill_group(proc)
            return "timeout"
        for key, _ in sel.select(left):
            fd = int(key.fd)
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                sel.unregister(fd)
                continue
            streams[fd].add(chunk)
            if cap is not None and sum(s.total for s in streams.values()) > cap:
                _kill_group(proc)
                return "output"
    return None

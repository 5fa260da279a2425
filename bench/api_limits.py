"""What unauthenticated and stalled connections cost the controller (issue 20, item 4).

    python bench/api_limits.py [--before SRC] [--json]

Starts a real controller (``python -m phalanx.cli controller``) on a temp state dir and:

- opens 100 connections that send no token, each announcing a body of 1,000,000
  bytes (under ``max_body_bytes``) and sending all of it but the last 10 bytes
  (held near-full, as the audit did), and reads the controller's RSS
  before (``VmRSS``) and its peak since it started (``VmHWM``) once they are all
  sent: ``rss_start_mb`` and ``rss_unauth_mb``;
- opens 300 authenticated connections whose body stalls after one byte, waits
  12 s (past the default ``controller.body_timeout_s`` of 10 s) and counts those
  the controller still holds open: ``stalled_open``.

With ``--before SRC`` (a ``src`` dir of another checkout, e.g. a worktree of the
commit before a change) it measures that code too, in the same run, and prints
both; the ratio of the RSS growth is the figure to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

BODY = 1_000_000
UNAUTH = 100
STALLED = 300
WAIT_S = 12.0


def _rss_mb(pid: int, field: str = "VmRSS") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1]) // 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _head(path: str, length: int, token: str | None) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


def measure(src: str | None) -> dict[str, Any]:
    state = Path(tempfile.mkdtemp(prefix="api-limits-"))
    env = {k: v for k, v in os.environ.items() if k != "PHALANX_TOKEN"}
    if src:
        env["PYTHONPATH"] = src
    args = [sys.executable, "-m", "phalanx.cli", "controller", "--state-dir", str(state)]
    p = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    try:
        assert p.stdout is not None
        line = p.stdout.readline().decode()  # "phalanx controller ... at URL"
        if " at http" not in line:
            raise RuntimeError(f"controller did not start: {line}")
        u = urlsplit((state / "url").read_text().strip())
        token = (state / "token").read_text().strip()
        host, port = u.hostname or "127.0.0.1", int(u.port or 0)
        rss_start = _rss_mb(p.pid)
        held = []
        for _ in range(UNAUTH):
            s = socket.create_connection((host, port))
            s.settimeout(5)
            try:
                s.sendall(_head("/v1/register", BODY, None) + b" " * (BODY - 10))
            except OSError:
                pass  # refused before the body: the controller closed the connection
            held.append(s)
        time.sleep(2.0)
        rss_unauth = _rss_mb(p.pid, "VmHWM")
        for s in held:
            s.close()
        stalled = []
        for _ in range(STALLED):
            s = socket.create_connection((host, port))
            s.sendall(_head("/v1/register", 100, token) + b"{")
            stalled.append(s)
        time.sleep(WAIT_S)
        still = 0
        for s in stalled:
            s.setblocking(False)
            try:
                data = s.recv(1 << 16)
                still += 0 if data == b"" or b" 408 " in data else 1
            except BlockingIOError:
                still += 1
            except OSError:
                pass
            s.close()
        return {
            "code": src or "this checkout",
            "rss_start_mb": rss_start,
            "rss_unauth_mb": rss_unauth,
            "stalled_open": still,
            "stalled": STALLED,
        }
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", help="src dir of another checkout to measure too")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    rows = ([measure(a.before)] if a.before else []) + [measure(None)]
    for r in rows:
        r["rss_growth_mb"] = r["rss_unauth_mb"] - r["rss_start_mb"]
        if a.json:
            print(json.dumps(r))
        else:
            print(
                f"{r['code']}: RSS {r['rss_start_mb']} -> peak {r['rss_unauth_mb']} MB with {UNAUTH} "
                f"unauthenticated near-full {BODY:,}-byte bodies; {r['stalled_open']}/{STALLED} stalled "
                f"bodies still open after {WAIT_S:.0f} s"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

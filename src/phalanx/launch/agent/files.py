"""The elastic agent's run dir and its control files: the pid file, resize requests
(``phalanx agent resize`` uses this module alone), atomic writes. Nothing heavy is
imported.

Run dir layout (one agent per run dir)::

    agent.pid          the running agent's pid (removed when it exits)
    resize.json        a pending operator request {"nproc": N}; the agent takes it on SIGHUP
    workers.json       the current generation: nproc, master port, each worker's pid and logs
    gen{G}/rank{R}.out the stdout of rank R in generation G (stderr in .err)
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from phalanx.launch.procs import pid_alive

PID_FILE = "agent.pid"
RESIZE_FILE = "resize.json"
WORKERS_FILE = "workers.json"


def read_pid(run_dir: Path) -> int | None:
    """The pid in ``run_dir``'s pid file if that process is alive, else None."""
    try:
        pid = int((run_dir / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) else None


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def request_resize(run_dir: Path, nproc: int) -> int:
    """Ask the agent running in ``run_dir`` to change its replica's layout to
    ``nproc`` workers: write :data:`RESIZE_FILE`, then SIGHUP the agent. Returns the
    agent's pid. Raises ValueError for a bad count or when no agent runs there."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1: got {nproc}.")
    pid = read_pid(run_dir)
    if pid is None:
        raise ValueError(
            f"the run dir must hold a running agent: got {run_dir} with no live pid in "
            f"{run_dir / PID_FILE}. Pass the --run-dir the agent was started with."
        )
    write_atomic(run_dir / RESIZE_FILE, json.dumps({"nproc": nproc}))
    os.kill(pid, signal.SIGHUP)
    return pid


def take_resize(run_dir: Path) -> int | None:
    """Consume a pending resize request: its worker count, or None if there is none.
    Raises ValueError (the request is still removed) when the file is malformed."""
    path = run_dir / RESIZE_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    path.unlink(missing_ok=True)
    try:
        n = json.loads(text)["nproc"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(
            f'{path} must hold {{"nproc": N}}: got {text[:100]!r}. '
            f"Use `phalanx agent resize --run-dir {run_dir} --nproc N`."
        ) from None
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"resize nproc must be a whole number >= 1: got {n!r}.")
    return n


def default_run_dir(name: str) -> Path:
    return Path("runs") / f"agent-{name}"


def resize_main(argv: list[str], run_dir: str | None = None) -> int:
    """``phalanx agent resize (--run-dir DIR | --name NAME) --nproc N``: send the
    request and wait until the agent took it."""
    import argparse
    import time

    p = argparse.ArgumentParser(
        prog="phalanx agent resize",
        description="Ask a running agent to restart its replica with another number of "
        "workers: they checkpoint, restart with the new WORLD_SIZE, reshard-load, rejoin.",
    )
    p.add_argument("--run-dir", default=run_dir, help="the agent's run dir")
    p.add_argument("--name", help="the agent's replica name (run dir runs/agent-NAME)")
    p.add_argument("--nproc", type=int, required=True, help="workers of the new layout")
    p.add_argument("--wait-s", type=float, default=10.0, help="how long to wait for the agent")
    a = p.parse_args(argv)
    if not a.run_dir and not a.name:
        p.error("--run-dir (or --name) must name the agent: got neither.")
    rd = Path(a.run_dir) if a.run_dir else default_run_dir(a.name)
    try:
        pid = request_resize(rd, a.nproc)
    except ValueError as e:
        raise SystemExit(f"phalanx agent resize: {e}") from None
    deadline = time.monotonic() + a.wait_s
    while (rd / RESIZE_FILE).exists():
        if time.monotonic() > deadline:
            raise SystemExit(
                f"phalanx agent resize: the agent (pid {pid}) must take the request within "
                f"{a.wait_s} s: it has not. See its stderr."
            )
        time.sleep(0.05)
    print(f"agent pid {pid} took the request: {a.nproc} worker(s)")
    return 0

"""The worker processes of one replica on this node (``phalanx agent``): each
generation's workers, started with torchrun's environment on a fresh master
port, in process groups of their own, and recorded in the run dir."""

from __future__ import annotations

import json
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.launch.agent.files import WORKERS_FILE, write_atomic
from phalanx.launch.agent.options import AgentOptions, expand, placeholders, worker_env
from phalanx.net import free_port


class AgentError(RuntimeError):
    """The agent cannot run (bad command, run dir taken)."""


@dataclass
class Worker:
    rank: int
    slot: int
    proc: subprocess.Popen[bytes]
    out: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def describe(self) -> str:
        code = self.proc.returncode
        if code is None:
            return "is running"
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "?"
            return f"was killed by signal {-code} ({name})"
        return f"exited with code {code}"


def start_workers(
    opts: AgentOptions,
    slots: list[int],
    generation: int,
    restarts: int,
    reason: str,
    port: int | None = None,
) -> tuple[list[Worker], dict[str, Any]]:
    """Start generation ``generation`` of the replica's workers, one per slot, each
    in its own process group with a torchrun-style environment on a fresh master
    port (``port``: the one node rank 0's agent picked, on a node that follows it);
    record them in the run dir's workers file. Returns the workers and the record
    (what the agent's ``start`` event says)."""
    if port is None:
        port = free_port()  # fresh per generation: never a broken generation's store
    gdir = opts.run_dir / f"gen{generation}"
    gdir.mkdir(parents=True, exist_ok=True)
    n = len(slots)
    workers = []
    for local, slot in enumerate(slots):
        ids = {"rank": local, "world_size": n, "slot": slot, "port": port}
        cmd = expand(opts.cmd, placeholders(opts, restart=generation, **ids))
        rank = opts.node_rank * n + local  # the replica's: what events and logs name
        out = gdir / f"rank{rank}.out"
        with out.open("wb") as fo, out.with_suffix(".err").open("wb") as fe:
            try:
                proc = subprocess.Popen(
                    cmd,
                    stdout=fo,
                    stderr=fe,
                    stdin=subprocess.DEVNULL,
                    env=worker_env(opts, restart=generation, base=None, **ids),
                    start_new_session=True,
                )
            except OSError as e:
                raise AgentError(
                    f"the worker command must be runnable: got {cmd[0]!r} ({e.strerror}). "
                    f"Check the command after `--`."
                ) from None
        workers.append(Worker(rank, slot, proc, out))
    record = {
        **({"node_rank": opts.node_rank} if opts.nnodes > 1 else {}),
        "generation": generation,
        "reason": reason,
        "restart": restarts,
        "nproc": n,
        "master_port": port,
        "dir": str(gdir),
        "workers": [
            {"rank": w.rank, "slot": w.slot, "pid": w.pid, "out": str(w.out)} for w in workers
        ],
    }
    write_atomic(opts.run_dir / WORKERS_FILE, json.dumps(record, indent=1))
    return workers, record

"""The elastic agent's pure parts: its options (built from the command line by
:mod:`phalanx.launch.agent.args`), the restart backoff, the workers' environment
and command placeholders. No processes are started here, and nothing heavy is
imported. The run dir's control files are :mod:`phalanx.launch.agent.files`'.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from phalanx import env

REPLICA_NAME = "PHALANX_REPLICA_NAME"
"""Set by the agent on every worker: the stable name of the replica it belongs to
(pass it to ``--name``, or use the ``{name}`` placeholder)."""
RESTART_COUNT = "PHALANX_RESTART_COUNT"
"""Set by the agent on every worker: how many times the agent has (re)started this
replica's workers before (0 for the first start), like torchrun's
``TORCHELASTIC_RESTART_COUNT``."""
SLOT = "PHALANX_SLOT"
"""Set by the agent on every worker: the local device slot the worker should use.
It equals ``LOCAL_RANK`` until the agent drops a lost slot; after that the
remaining slots keep their numbers while ranks are renumbered 0..N-1."""
CKPT = "PHALANX_CKPT"
"""Set by the agent on every worker when ``--ckpt`` is given: the checkpoint URL
the workers save to and resume from."""

LATEST_POINTER = "latest"
"""``phalanx.checkpoint.base.LATEST``, repeated here so that the agent does not
import torch (the checkpoint package does); a unit test keeps the two equal."""

PLACEHOLDERS = (
    "name",
    "rank",
    "local_rank",
    "world_size",
    "node_rank",
    "nnodes",
    "slot",
    "restart",
    "port",
    "run_dir",
    "controller",
    "ckpt",
)
"""``{key}`` in the worker command is replaced per worker; other braces are left alone."""
_PLACEHOLDER = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")


@dataclass(frozen=True)
class AgentOptions:
    """What ``phalanx agent`` was asked to run. Build it, then call :meth:`check`."""

    name: str
    """Stable name of the replica whose workers this agent runs."""
    cmd: list[str]
    """The worker command (placeholders expanded per worker)."""
    run_dir: Path
    controller: str | None = None
    """The job's controller (URL or state dir): exits are reported there at once."""
    nproc: int = 1
    """Workers (ranks) of the replica on this node at the start."""
    min_nproc: int | None = None
    """The fewest workers the agent shrinks to by itself when a slot is lost
    (default: ``nproc``, i.e. never). An operator's resize is not bound by it."""
    max_restarts: int = 3
    """Restarts after failures before the agent gives up (layout changes an
    operator asked for are free)."""
    backoff_s: float = 1.0
    """Delay before the first restart after a failure; doubles with each one."""
    backoff_max_s: float = 30.0
    grace_s: float = 30.0
    """After SIGTERM (layout change, agent stop), how long workers get to
    checkpoint and exit before SIGKILL."""
    fail_grace_s: float = 3.0
    """After a worker failed, how long the replica's other workers get to exit
    after SIGTERM (they cannot checkpoint: their process group is broken)."""
    lost_slot_after: int = 2
    """A slot whose worker fails first this many times in a row is lost."""
    ckpt: str | None = None
    node: str = field(default_factory=lambda: os.uname().nodename)
    """This node's name, in reports to the controller."""
    serve_controller: tuple[str, ...] | None = None
    """The job's controller arguments (``--config`` and overrides) when this agent
    also runs the controller, on the state dir ``controller`` names, and starts it
    again when it dies. With no worker command the agent runs the controller only."""
    nnodes: int = 1
    """Nodes the replica spans, each with an agent of its own and ``nproc`` workers
    (:mod:`phalanx.launch.agent.nodes`)."""
    node_rank: int = 0
    """This node's place in the replica: its workers are ranks ``node_rank * nproc``
    on. Node 0's agent leads: it runs rank 0 and the replica's rendezvous."""
    master: tuple[str, int] | None = None
    """Node rank 0's address and rendezvous port (``--master-addr HOST[:PORT]``), which
    every node reaches; rank 0's store listens on that host too. Needed with
    ``nnodes > 1``."""
    rdzv_timeout_s: float = 300.0
    """How long a node other than 0 waits for node 0's agent to start a generation."""
    track: str | None = None
    """The job config whose ``[track]`` this agent logs the job's metrics by (one
    agent per job: :mod:`phalanx.launch.agent.track`); None: it logs nothing."""

    @property
    def controller_only(self) -> bool:
        return self.serve_controller is not None and not self.cmd

    @property
    def floor(self) -> int:
        return self.nproc if self.min_nproc is None else self.min_nproc

    def check(self) -> AgentOptions:
        """Raise ValueError, one clear line, on the first bad option; else return self."""
        if self.serve_controller is not None and (
            not self.controller or self.controller.startswith(("http://", "https://"))
        ):
            raise ValueError(
                "--serve-controller runs the controller on its state dir: --controller must "
                f"name that directory, got {self.controller!r}. Pass --controller DIR."
            )
        if self.controller_only:
            return self
        if not self.name or any(c in self.name for c in ":/ \t\n"):
            raise ValueError(
                f"--name must be a non-empty replica name without ':', '/' or spaces: got "
                f"{self.name!r}. Use e.g. --name policy-0."
            )
        if not self.cmd:
            raise ValueError(
                "the worker command must follow `--`: got none. Write e.g. "
                "`phalanx agent --name r0 -- python train.py`, or pass --config to run "
                "`phalanx replica` of that job."
            )
        for what, v, lo in (
            ("--nproc", self.nproc, 1),
            ("--min-nproc", self.floor, 1),
            ("--max-restarts", self.max_restarts, 0),
            ("--lost-slot-after", self.lost_slot_after, 1),
        ):
            if v < lo:
                raise ValueError(f"{what} must be >= {lo}: got {v}.")
        if self.floor > self.nproc:
            raise ValueError(
                f"--min-nproc must be <= --nproc: got --min-nproc {self.floor} with "
                f"--nproc {self.nproc}. Lower --min-nproc or raise --nproc."
            )
        self._check_nodes()
        for what, s in (
            ("--backoff-s", self.backoff_s),
            ("--backoff-max-s", self.backoff_max_s),
            ("--grace-s", self.grace_s),
            ("--fail-grace-s", self.fail_grace_s),
        ):
            if not s >= 0:
                raise ValueError(f"{what} must be >= 0 seconds: got {s}.")
        if self.backoff_max_s < self.backoff_s:
            raise ValueError(
                f"--backoff-max-s must be >= --backoff-s: got {self.backoff_max_s} < "
                f"{self.backoff_s}."
            )
        return self

    def _check_nodes(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"--nnodes must be >= 1: got {self.nnodes}.")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(
                f"--node-rank must be in [0, --nnodes): got --node-rank {self.node_rank} with "
                f"--nnodes {self.nnodes}. Number the replica's nodes 0 to {self.nnodes - 1}."
            )
        if self.nnodes == 1:
            return
        if self.master is None:
            raise ValueError(
                f"--master-addr must name node rank 0's address for a replica across "
                f"{self.nnodes} nodes: got none. Pass --master-addr HOST[:PORT] to every agent."
            )
        if self.floor != self.nproc:
            raise ValueError(
                f"--min-nproc applies to a replica on one node: got --min-nproc {self.floor} "
                f"with --nnodes {self.nnodes} (a replica across nodes keeps its layout). Drop it."
            )
        if self.track and self.node_rank:
            raise ValueError(
                f"--track must be given to the agent of node rank 0 (it sees the replica's "
                f"step lines): got it with --node-rank {self.node_rank}."
            )
        if not self.rdzv_timeout_s > 0:
            raise ValueError(f"--rdzv-timeout-s must be > 0 seconds: got {self.rdzv_timeout_s}.")

    @property
    def master_host(self) -> str:
        """``MASTER_ADDR`` of the workers: node rank 0's address, else loopback."""
        return self.master[0] if self.master else "127.0.0.1"


def backoff_delay(k: int, base_s: float, cap_s: float) -> float:
    """Delay before the restart that follows ``k`` earlier failure restarts:
    ``base_s * 2**k``, capped at ``cap_s``."""
    if k < 0:
        raise ValueError(f"restart index must be >= 0: got {k}.")
    return min(cap_s, base_s * 2.0 ** min(k, 60))


def expand(cmd: list[str], values: dict[str, str]) -> list[str]:
    """Replace the known ``{placeholders}`` (:data:`PLACEHOLDERS`) in each argument.
    Unknown braces stay as they are, so ``python -c '{...}'`` is safe."""
    return [_PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), a) for a in cmd]


def worker_env(
    opts: AgentOptions,
    *,
    rank: int,
    world_size: int,
    slot: int,
    port: int,
    restart: int,
    base: dict[str, str] | None = None,
) -> dict[str, str]:
    """The environment of local worker ``rank`` of ``world_size`` on this node:
    torchrun's (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
    ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), the
    global ones over the replica's ``opts.nnodes`` nodes, plus phalanx's identity
    variables."""
    e = dict(os.environ if base is None else base)
    e.update(
        RANK=str(opts.node_rank * world_size + rank),
        LOCAL_RANK=str(rank),
        GROUP_RANK=str(opts.node_rank),
        GROUP_WORLD_SIZE=str(opts.nnodes),
        WORLD_SIZE=str(opts.nnodes * world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=opts.master_host,
        MASTER_PORT=str(port),
        PYTHONUNBUFFERED="1",
    )
    e[REPLICA_NAME] = opts.name
    e[RESTART_COUNT] = str(restart)
    e[SLOT] = str(slot)
    if opts.controller:
        e[env.CONTROLLER] = opts.controller
    if opts.ckpt:
        e[CKPT] = opts.ckpt
    if world_size > 1:
        # As torchrun does: N workers each with all cores' threads oversubscribe.
        e.setdefault("OMP_NUM_THREADS", "1")
    return e


def placeholders(
    opts: AgentOptions, *, rank: int, world_size: int, slot: int, port: int, restart: int
) -> dict[str, str]:
    return {
        "name": opts.name,
        "rank": str(opts.node_rank * world_size + rank),
        "local_rank": str(rank),
        "world_size": str(opts.nnodes * world_size),
        "node_rank": str(opts.node_rank),
        "nnodes": str(opts.nnodes),
        "slot": str(slot),
        "restart": str(restart),
        "port": str(port),
        "run_dir": str(opts.run_dir),
        "controller": opts.controller or "",
        "ckpt": opts.ckpt or "",
    }


def latest_step(url: str) -> int | None:
    """The step that the checkpoint root ``url``'s ``latest`` pointer names; None
    when there is none or it cannot be read. For the agent's events only: the
    workers load through :mod:`phalanx.checkpoint`, which verifies what it loads."""
    try:
        import fsspec

        fs, root = fsspec.core.url_to_fs(url)
        return int(json.loads(fs.cat_file(f"{root.rstrip('/')}/{LATEST_POINTER}"))["step"])
    except (ImportError, OSError, ValueError, KeyError, TypeError):
        return None

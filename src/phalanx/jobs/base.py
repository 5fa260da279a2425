"""What every job loop takes, and how the registry names it.

A *job loop* is the main loop of one kind of process: a replica of an FT-DDP
job, a slot of a decoupled DiLoCo job, an RL policy or rollout replica, the
DiLoCo syncer. Each lives in a module of this package with a
``run(args: ReplicaArgs) -> int`` entry point (the process's exit status);
:data:`phalanx.jobs.JOBS` maps each kind to its module, and ``phalanx
replica`` dispatches through it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phalanx.config import JobConfig


class JobError(ValueError):
    """A job loop cannot run as asked (a config or argument that does not fit it).
    The CLI prints it in one line."""


EXIT_UNRECOVERABLE = 78
"""A replica's exit code when starting it again cannot help (``EX_CONFIG`` of
sysexits.h): a :class:`JobError`, or no usable checkpoint to resume from. It has
said why in one line on stderr; ``phalanx run`` and ``phalanx agent`` stop instead
of restarting it into a crash loop."""


@dataclass(frozen=True)
class ReplicaArgs:
    cfg: JobConfig
    name: str
    """Stable replica name (each start is a new incarnation of it)."""
    controller: str | None = None
    """The controller's URL or state dir."""
    out: Path | None = None
    """Where to write the final state (safetensors), if anywhere."""
    state: Path | None = None
    """RL policy replicas: the file holding the latest committed state."""
    role: str = "policy"


@dataclass(frozen=True)
class JobSpec:
    kind: str
    module: str
    summary: str
    roles: tuple[str, ...] = ("policy",)
    """Roles ``phalanx replica --role`` may start it as (empty: not a replica)."""
    needs_controller: bool = True
    takes_out: bool = True
    takes_state: bool = False

    def load(self) -> Callable[[ReplicaArgs], int]:
        """The loop's entry point (imported now, not before: ``--help`` stays fast)."""
        run: Callable[[ReplicaArgs], int] = importlib.import_module(self.module).run
        return run

    def check(self, args: ReplicaArgs) -> None:
        """Refuse arguments this kind of process does not take, in one line."""
        if self.roles and args.role not in self.roles:
            raise JobError(
                f"--role must be {' or '.join(self.roles)} for a {self.kind} job: got "
                f"{args.role!r}. {_ROLE_HINT.get(self.kind, '')}".rstrip()
            )
        if args.state is not None and not self.takes_state:
            raise JobError(
                f"--state is only for policy replicas of an RL job: got --state {args.state} "
                f"for a {self.kind} process. Drop --state "
                f"({_STATE_HINT.get(self.kind, 'it keeps no state file')})."
            )
        if args.out is not None and not self.takes_out:
            raise JobError(
                f"--out is not taken by a {self.kind} process: got --out {args.out}. Drop it "
                "(it keeps no state)."
            )
        if self.needs_controller and not args.controller:
            raise JobError(
                f"--controller must name the controller (URL or state dir) for a {self.kind} "
                "process: got none. Pass --controller or set $PHALANX_CONTROLLER."
            )


_ROLE_HINT = {
    "ft_ddp": "Rollout replicas need an RL job: pass a job config with an [rl] section.",
    "diloco_sync": "Rollout replicas need an RL job: pass a job config with an [rl] section.",
    "diloco_slot": "A decoupled DiLoCo slot is a policy replica.",
}
_STATE_HINT = {
    "ft_ddp": "FT replicas heal from their peers",
    "diloco_sync": "FT replicas heal from their peers",
    "diloco_slot": "its state lives under diloco.url",
    "rl_diloco": "its state lives under diloco.url",
    "rl_rollout": "rollout replicas keep no state",
}

"""One module per process loop, and the registry ``phalanx replica`` dispatches through.

=================  =====================================================================
kind               loop
=================  =====================================================================
``ft_ddp``         a replica of the FT data-parallel job (``ft_ddp.py``)
``ft_hsdp``        one rank of an FT replica of several ranks (``ft_hsdp.py``)
``diloco_sync``    a replica of synchronous DiLoCo over the FT group (``diloco_sync.py``)
``diloco_slot``    a slot of decoupled DiLoCo, exchanging through storage (``diloco_slot.py``)
``diloco_syncer``  the aggregator of decoupled DiLoCo rounds (``diloco_syncer.py``)
``rl_policy``      an RL policy replica: GRPO under the FT manager (``rl_policy.py``)
``rl_rollout``     an RL rollout replica: lease, generate, submit (``rl_rollout.py``)
``rl_diloco``      an RL policy slot over decoupled DiLoCo (``rl_diloco.py``)
``rl_single``      single-process GRPO, the RL baseline (``rl_single.py``)
``tp_worker``      one rank of a tensor-parallel replica (``tp_worker.py``)
``script``         your own training loop, ``[train] script`` (``script.py``)
=================  =====================================================================

``common.py`` holds what the FT loops share (setup, checkpoints, the step
boundary, the JSON lines they print); ``mlp.py`` the built-in FT task.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from phalanx.jobs.base import EXIT_UNRECOVERABLE, JobError, JobSpec, ReplicaArgs

if TYPE_CHECKING:
    from phalanx.config import JobConfig

__all__ = [
    "EXIT_UNRECOVERABLE",
    "JOBS",
    "JobError",
    "JobSpec",
    "ReplicaArgs",
    "job_kind",
    "spec_for",
]

JOBS: dict[str, JobSpec] = {
    s.kind: s
    for s in (
        JobSpec("ft_ddp", "phalanx.jobs.ft_ddp", "fault-tolerant data-parallel replica"),
        JobSpec(
            "ft_hsdp",
            "phalanx.jobs.ft_hsdp",
            "one rank of a fault-tolerant replica of several ranks (FSDP2 inside)",
        ),
        JobSpec("diloco_sync", "phalanx.jobs.diloco_sync", "synchronous DiLoCo replica"),
        JobSpec(
            "diloco_slot",
            "phalanx.jobs.diloco_slot",
            "decoupled DiLoCo slot (no network path to its peers)",
            needs_controller=False,
        ),
        JobSpec(
            "diloco_syncer",
            "phalanx.jobs.diloco_syncer",
            "aggregator of decoupled DiLoCo rounds",
            roles=(),
            needs_controller=False,
            takes_out=False,
        ),
        JobSpec(
            "rl_policy",
            "phalanx.jobs.rl_policy",
            "RL policy replica (GRPO under the FT manager)",
            takes_state=True,
        ),
        JobSpec(
            "rl_diloco",
            "phalanx.jobs.rl_diloco",
            "RL policy slot over decoupled DiLoCo (its own batches, rounds through storage)",
        ),
        JobSpec(
            "rl_rollout",
            "phalanx.jobs.rl_rollout",
            "RL rollout replica (lease, generate, submit)",
            roles=("rollout",),
            takes_out=False,
        ),
        JobSpec(
            "rl_single",
            "phalanx.jobs.rl_single",
            "single-process GRPO (the baseline)",
            roles=(),
            needs_controller=False,
            takes_out=False,
        ),
        JobSpec("script", "phalanx.jobs.script", "your own training loop ([train] script)"),
        JobSpec(
            "tp_worker",
            "phalanx.jobs.tp_worker",
            "one rank of a tensor-parallel replica (python -m phalanx.jobs.tp_worker)",
            roles=(),
            needs_controller=False,
        ),
    )
}


def job_kind(cfg: JobConfig, role: str) -> str:
    """The kind of replica ``phalanx replica --role ROLE`` starts for this job config."""
    if cfg.rl is not None:
        if role == "rollout":
            return "rl_rollout"
        return "rl_diloco" if cfg.diloco is not None else "rl_policy"
    if cfg.train.script:
        return "script"
    if cfg.diloco is not None:
        return "diloco_slot" if cfg.diloco.mode == "objectstore" else "diloco_sync"
    return "ft_hsdp" if cfg.replica.ranks > 1 else "ft_ddp"


def spec_for(args: ReplicaArgs) -> JobSpec:
    """The registry's entry for these replica arguments, checked against them."""
    spec = JOBS[job_kind(args.cfg, args.role)]
    spec.check(args)
    return spec

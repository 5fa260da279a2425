"""The fault actions, each on the launcher's own process handles: a replica's
process group (signalled through :func:`~phalanx.launch.procs.signal_proc`), a
controller's process group, or an engine worker's own pid found as a child of its
replica's process. Nothing is ever signalled by name.

Each action is called with the launcher's lock held (it reads and changes the
replicas' ``proc``) and returns whether it delivered its fault: a fault that
cannot land yet (a replica down, one still starting) stays due.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

from phalanx.launch.chaos.log import ChaosLog
from phalanx.launch.chaos.schedule import Schedule
from phalanx.launch.procs import signal_group, signal_proc
from phalanx.launch.replica import Replica

if TYPE_CHECKING:
    from phalanx.launch.chaos.base import ChaosTarget


def where(r: Replica) -> dict[str, int]:
    """How far a replica got: its step (policy) or its rollouts (rollout)."""
    return {"step": r.step} if r.role == "policy" else {"rollouts": r.rollouts}


def _at(r: Replica) -> str:
    return f"step {r.step}" if r.role == "policy" else f"{r.rollouts} rollouts"


def ready(job: ChaosTarget, stopped: set[str]) -> list[Replica] | None:
    """The replicas a replica fault may hit, or None while one may not land: every
    replica must be up, unstopped, and have made progress since its start, so that
    at most one is down at a time. An FT job also needs two: a healthy peer must
    hold the job's state (policy replicas of an RL job resume from their state file
    instead)."""
    reps = [r for r in job.replicas.values() if r.retiring_since is None and not r.done]
    alive = [r for r in reps if r.running and r.progress and r.name not in stopped]
    if not reps or len(alive) < len(reps) or (not job.rl and len(alive) < 2):
        return None
    return sorted(alive, key=lambda r: r.name)


def kill_replica(
    job: ChaosTarget, r: Replica, restart_after_s: float, log: ChaosLog, kind: str, **detail: object
) -> None:
    """SIGKILL replica ``r``'s process group, reap it, and have the launcher restart it
    after ``restart_after_s`` (its supervision does: ``restart_at``)."""
    assert r.proc is not None
    pid, at = r.proc.pid, where(r)
    signal_proc(r.proc, signal.SIGKILL)
    r.proc.wait()
    r.proc = None
    r.kills += 1
    if job.tracking is not None:
        job.tracking.killed()
    r.restart_at = time.monotonic() + restart_after_s
    log.fault(kind, r.name, pid, f"SIGKILL {r.name} at {_at(r)}", **at, **detail)


def kill(job: ChaosTarget, sched: Schedule, log: ChaosLog, stopped: set[str]) -> bool:
    alive = ready(job, stopped)
    if alive is None:
        return False
    kill_replica(job, sched.pick("kill", alive), sched.spec.restart_after_s, log, "kill")
    return True


def stop(
    job: ChaosTarget,
    sched: Schedule,
    log: ChaosLog,
    stopped: dict[str, tuple[int, float]],
    busy: set[str] | None = None,
) -> bool:
    """SIGSTOP a replica's process group; ``stopped`` gets its name -> (pid, when to
    SIGCONT it, monotonic), which the runner honours (:func:`resume`). ``busy``: other
    replicas a fault holds (cut off), which count as down."""
    alive = ready(job, set(stopped) | (busy or set()))
    if alive is None:
        return False
    r = sched.pick("stop", alive)
    assert r.proc is not None
    secs = sched.stop_for()
    signal_proc(r.proc, signal.SIGSTOP)
    stopped[r.name] = (r.proc.pid, time.monotonic() + secs)
    log.fault(
        "stop", r.name, r.proc.pid, f"SIGSTOP {r.name} at {_at(r)} for {secs:.1f} s",
        **where(r), stop_s=round(secs, 3),
    )  # fmt: skip
    return True


def resume(job: ChaosTarget, name: str, pid: int, why: str) -> None:
    """SIGCONT the process group a stop froze (``pid``: its leader when stopped). The
    replica's current process is signalled through its handle; one that died or was
    replaced meanwhile is signalled by the stopped group's id (a group gone is fine)."""
    r = job.replicas.get(name)
    if r is not None and r.proc is not None and r.proc.pid == pid:
        signal_proc(r.proc, signal.SIGCONT)
    else:
        signal_group(pid, signal.SIGCONT)
    job.note(f"chaos: SIGCONT {name} ({why})")


def engine_workers(pid: int) -> list[int]:
    """The child processes of process ``pid`` (Linux ``/proc``): a vLLM engine's
    worker processes when ``pid`` is a rollout replica with ``tensor_parallel_size >
    1`` (vLLM's ``mp`` executor forks them from the replica's process)."""
    kids: list[int] = []
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return []
    for task in tasks:
        try:
            kids += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
    return sorted(set(kids))


def engine_kill(job: ChaosTarget, sched: Schedule, log: ChaosLog, stopped: set[str]) -> bool:
    """SIGKILL a rollout replica's engine. vLLM with ``tensor_parallel_size > 1`` runs
    its workers as processes of their own: one of them (drawn) is SIGKILLed, and the
    replica finds its engine broken (it exits and the launcher restarts it). The HF
    engine and vLLM with one worker run inside the replica's process: the replica is
    SIGKILLed, and restarts after ``restart-after``."""
    alive = ready(job, stopped)
    if alive is None:
        return False
    rollouts = [r for r in alive if r.role == "rollout"]
    if not rollouts:
        return False
    r = sched.pick("engine-kill", rollouts)
    assert r.proc is not None and job.cfg.rl is not None
    engine = job.cfg.rl.engine
    if engine.kind == "vllm" and engine.tensor_parallel_size > 1 and not hasattr(r.proc, "deliver"):
        workers = engine_workers(r.proc.pid)
        if not workers:
            return False  # its engine is not up yet
        pid = sched.pick("engine-kill", workers)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return False
        log.fault(
            "engine-kill", r.name, pid, f"SIGKILL {r.name}'s vLLM worker (pid {pid}) at {_at(r)}",
            **where(r), engine="vllm", workers=len(workers), replica_pid=r.proc.pid,
        )  # fmt: skip
        return True
    kill_replica(
        job, r, sched.spec.restart_after_s, log, "engine-kill",
        engine=f"{engine.kind} (in the replica's process)",
    )  # fmt: skip
    return True


def controller_kill(job: ChaosTarget, sched: Schedule, log: ChaosLog) -> bool:
    """SIGKILL one controller process (drawn among those up) once every controller
    answers; the launcher's supervision restarts it on its state dir and port, and
    the replicas re-attach by themselves."""
    if job.controller is None:
        return False
    members = job.controller.members()
    if not members or not all(m.up for m in members):
        return False
    i = sched.pick("controller-kill", range(len(members)))
    m = members[i]
    pid = m.pid()
    if pid is None:
        return False
    signal_group(pid, signal.SIGKILL)
    name = "controller" if i == 0 else f"controller-{i}"
    log.fault("controller-kill", name, pid, f"SIGKILL {name} (pid {pid})", restarts=m.restarts)
    return True

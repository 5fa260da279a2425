"""The chaos runner: what ``phalanx run --chaos`` adds to the launcher's loop.

- :meth:`ChaosRunner.tick`, from the launcher's loop: ends the stops whose time
  came, and delivers each periodic fault that is due (:mod:`.schedule`) through
  :mod:`.faults`.
- A thread of its own for ``slow``: the slowed replica's process group is
  SIGSTOPped for ``F`` of every cycle and SIGCONTed for the rest, on whichever
  process the replica runs now (a restart is slowed too). With ``all-every``, a
  drawn ``slow`` names its replica and its end (:meth:`ChaosRunner._slow_one`);
  the thread throttles whichever replica is named, while it is.
- ``partition`` (:mod:`.partition`): a replica's packets dropped by an nftables rule
  for a drawn time; :meth:`ChaosRunner.tick` deletes the rule when it is over.
- :meth:`ChaosRunner.close`, in the launcher's ``finally`` (and as soon as the job
  finished): the slow thread ends, every process a fault stopped is continued and
  every partition healed (the run's nftables table deleted), so that no replica is
  left stopped or cut off, whatever ended the run.

:func:`check` refuses, in one line, a fault the job cannot take before anything
starts.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import TYPE_CHECKING

from phalanx.launch.chaos import faults, partition
from phalanx.launch.chaos.log import ChaosLog
from phalanx.launch.chaos.schedule import Schedule
from phalanx.launch.chaos.spec import ALL_KIND, Chaos
from phalanx.launch.procs import Proc, signal_proc

if TYPE_CHECKING:
    from phalanx.config import JobConfig
    from phalanx.launch.chaos.base import ChaosTarget


def check(spec: Chaos, cfg: JobConfig, counts: dict[str, int], launcher: str = "local") -> None:
    """Raise ``ValueError`` (one line) for a fault kind this job, this launcher or this
    user cannot have. ``counts``: the replicas launched per role; ``launcher``: ``phalanx
    run --launcher``'s (``partition-every`` only on this host: :mod:`.partition`)."""
    if spec.partition_every_s is not None:
        why = partition.unavailable()
        if why is not None:
            raise ValueError(why)
        if launcher != "local":
            raise ValueError(
                f"--chaos partition-every needs the replicas on this host (it drops their "
                f"packets with nftables here): got --launcher {launcher}. Use --launcher "
                f"local, or drop partition-every."
            )
    if spec.engine_kill_every_s is not None and (cfg.rl is None or not counts.get("rollout")):
        raise ValueError(
            "--chaos engine-kill-every needs a job with rollout replicas (it kills a rollout "
            "replica's engine): this job has none. Use kill-every, or an RL job."
        )
    if spec.slow is not None:
        names = [f"{role}-{i}" for role, n in counts.items() for i in range(n)]
        roles = [role for role, n in counts.items() if n]
        if spec.slow not in names and spec.slow not in roles:
            raise ValueError(
                f"--chaos slow must name a replica ({', '.join(names)}) or a role "
                f"({', '.join(roles)}) of this job: got slow={spec.slow!r}."
            )


class ChaosRunner:
    """Who calls: the launcher's loop thread (:meth:`start`, :meth:`tick`,
    :meth:`close`); the runner takes the launcher's lock itself."""

    def __init__(self, spec: Chaos, job: ChaosTarget):
        self.spec, self.job = spec, job
        self.sched = Schedule(spec, time.monotonic())
        self.log = ChaosLog(job.run_dir, job.note)
        self.stopped: dict[str, tuple[int, float]] = {}
        """Replicas a ``stop`` froze: name -> (pid of the group stopped, when to continue it)."""
        self.cuts = partition.Cuts()
        self.cut: dict[str, tuple[int, float]] = {}
        """Replicas a ``partition`` cut off: name -> (its nftables rule, when to heal it)."""
        self.rejoining: dict[str, tuple[int, int]] = {}
        """Replicas continued from a stop or healed of a partition that have not made
        progress since: name -> (its pid, its steps or rollouts then). Evicted while
        stopped or cut off, each may still have to rejoin (and heal from a peer), so it
        counts as down until it moves on."""
        self.slow_target: str | None = None
        self.slow_until: float | None = None
        """When a drawn ``slow`` ends (monotonic; None: ``slow=``, for the whole job)."""
        self.drawable: list[str] = []
        """``all-every``: the kinds this job can take (:meth:`start`)."""
        self._quit = threading.Event()
        self._slow: threading.Thread | None = None
        self._closed = False

    def start(self) -> None:
        """Start slowing (``slow``), or the slow thread a drawn ``slow`` needs
        (``all-every``); the periodic kinds start with :meth:`tick`."""
        if self.spec.all_every_s is not None:
            self.drawable = drawable(self.job)
            if "slow" in self.drawable:
                self._slow = threading.Thread(
                    target=self._slow_loop, name="chaos-slow", daemon=True
                )
                self._slow.start()
            return
        if self.spec.slow is None:
            return
        with self.job.lock:
            if self.spec.slow in self.job.replicas:
                self.slow_target = self.spec.slow
            else:
                names = sorted(n for n, r in self.job.replicas.items() if r.role == self.spec.slow)
                self.slow_target = self.sched.pick("slow", names) if names else None
        if self.slow_target is not None:
            self._slow = threading.Thread(target=self._slow_loop, name="chaos-slow", daemon=True)
            self._slow.start()

    def tick(self) -> None:
        """One pass: continue the stops that are over, deliver the faults that are due.
        Once the job finished, no fault lands and nothing stays stopped."""
        finished = self.job.finished()
        if finished:
            self.close()
            return
        now = time.monotonic()
        with self.job.lock:
            for name, (pid, until) in list(self.stopped.items()):
                if now >= until:
                    del self.stopped[name]
                    faults.resume(self.job, name, pid, "its stop is over")
                    self._rejoin(name)
            for name, (handle, until) in list(self.cut.items()):
                if now >= until:
                    del self.cut[name]
                    partition.heal(self.job, self.cuts, name, handle, "its partition is over")
                    self._rejoin(name)
            for kind in self.sched.due(now):
                if self._deliver(kind):
                    self.sched.fired(kind, time.monotonic())

    def _rejoin(self, name: str) -> None:
        """Replica ``name`` is continued or healed (lock held): it counts as down until
        it moves on, since it may have been evicted meanwhile and must rejoin."""
        r = self.job.replicas.get(name)
        if r is not None and r.proc is not None:
            self.rejoining[name] = (r.proc.pid, sum(faults.where(r).values()))

    def _deliver(self, kind: str) -> bool:
        job, sched, log = self.job, self.sched, self.log
        busy = self._busy()  # one replica fault at a time
        if kind == "kill":
            return faults.kill(job, sched, log, busy)
        if kind == "stop":
            return faults.stop(job, sched, log, self.stopped, busy - set(self.stopped))
        if kind == "engine-kill":
            return faults.engine_kill(job, sched, log, busy)
        if kind == "partition":
            return partition.partition(job, sched, log, busy, self.cuts, self.cut)
        if kind == "controller-kill":
            return faults.controller_kill(job, sched, log)
        if kind == ALL_KIND:
            drawn = sched.draw_kind(self.drawable)
            return self._slow_one() if drawn == "slow" else self._deliver(drawn)
        raise ValueError(f"--chaos {kind} cannot be delivered by this launcher.")

    def _busy(self) -> set[str]:
        """The replicas a fault holds (lock held): stopped, cut off, or continued or
        healed and not yet moved on (a replica restarted since is not: its own
        progress since its start is what :func:`faults.ready` waits for)."""
        for name, (pid, mark) in list(self.rejoining.items()):
            r = self.job.replicas.get(name)
            gone = r is None or r.proc is None or r.proc.pid != pid
            if gone or r is None or sum(faults.where(r).values()) > mark:
                del self.rejoining[name]
        return set(self.stopped) | set(self.cut) | set(self.rejoining)

    def close(self) -> None:
        """End the slowing, continue every stopped replica and heal every partition, its
        nftables table deleted (idempotent). Call it in the launcher's ``finally``,
        before it stops its children: a stopped process takes no SIGTERM."""
        if self._closed:
            return
        self._closed = True
        self._quit.set()
        if self._slow is not None:
            self._slow.join()
        with self.job.lock:
            for name, (pid, _) in list(self.stopped.items()):
                faults.resume(self.job, name, pid, "the run is ending")
            self.stopped.clear()
            for name in sorted(self.cut):
                self.job.note(f"chaos: heal {name} (the run is ending)")
            self.cut.clear()
            try:
                self.cuts.close()
            except RuntimeError as e:  # the children must still be stopped
                self.job.note(f"chaos: {e}")

    # -- slow --------------------------------------------------------------

    def _slow_one(self) -> bool:
        """A drawn ``slow`` (``all-every``; the lock held): a replica drawn among those a
        fault may hit is throttled for a drawn time. One at a time: while one lasts,
        the next stays due."""
        if self.slow_target is not None:
            return False
        alive = faults.ready(self.job, self._busy())
        if alive is None:
            return False
        r = self.sched.pick("slow", alive)
        assert r.proc is not None
        secs, frac, cycle = self.sched.slow_for(), self.spec.slow_fraction, self.spec.slow_cycle_s
        self.slow_target, self.slow_until = r.name, time.monotonic() + secs
        self.log.fault(
            "slow", r.name, r.proc.pid,
            f"slow {r.name}: SIGSTOP {frac:.0%} of every {cycle:g} s for {secs:.1f} s",
            **faults.where(r), fraction=frac, cycle_s=cycle, slow_s=round(secs, 3),
        )  # fmt: skip
        return True

    def _slow_loop(self) -> None:
        """SIGSTOP the slowed replica for ``F`` of every cycle, SIGCONT it for the rest,
        while it runs and no ``stop`` holds it; once it made progress since its start
        (its start-up is not what is slowed). ``slow=``: logged once per process
        slowed; a drawn slow was logged when drawn, and ends at ``slow_until``."""
        frac, cycle = self.spec.slow_fraction, self.spec.slow_cycle_s
        seen: int | None = None
        while not self._quit.is_set():
            proc: Proc | None = None
            with self.job.lock:
                name = self.slow_target
                if self.slow_until is not None and time.monotonic() >= self.slow_until:
                    self.job.note(f"chaos: SIGCONT {name} (its slow is over)")
                    name = self.slow_target = self.slow_until = None
                r = self.job.replicas.get(name) if name is not None else None
                if r is not None and r.running and r.progress and r.name not in self.stopped:
                    proc = r.proc
                if r is not None and proc is not None:
                    signal_proc(proc, signal.SIGSTOP)
                    if proc.pid != seen and self.spec.slow is not None:
                        seen = proc.pid
                        self.log.fault(
                            "slow", r.name, proc.pid,
                            f"slow {r.name}: SIGSTOP {frac:.0%} of every {cycle:g} s (pid {proc.pid})",
                            fraction=frac, cycle_s=cycle,
                        )  # fmt: skip
            if proc is None:
                self._quit.wait(cycle)
                continue
            try:
                self._quit.wait(frac * cycle)
            finally:
                with self.job.lock:
                    if name not in self.stopped:  # else a stop holds it, and continues it
                        signal_proc(proc, signal.SIGCONT)
            self._quit.wait((1 - frac) * cycle)


def drawable(job: ChaosTarget) -> list[str]:
    """The kinds ``all-every`` draws from for this job, in :data:`KINDS` order: every
    kind the launcher delivers that the job can take (``engine-kill`` only with
    rollout replicas; ``partition`` where the launcher gave each replica a gid of its
    own, which it does as root with nftables installed: :mod:`.partition`)."""
    kinds = ["kill", "stop"]
    if job.controller is not None:
        kinds.append("controller-kill")
    if job.rl and any(r.role == "rollout" for r in job.replicas.values()):
        kinds.append("engine-kill")
    if job.gids is not None:
        kinds.append("partition")
    return [*kinds, "slow"]

"""What an operator or the chaos option does to a local job's replica set, beside
its supervision (:mod:`phalanx.launch.local`): follow the counts ``phalanx scale``
asks for, and SIGKILL a random replica on a period (``--chaos``)."""

from __future__ import annotations

import random
import signal
import time
from typing import TYPE_CHECKING

from phalanx.launch.procs import signal_proc
from phalanx.launch.replica import Replica

if TYPE_CHECKING:
    from phalanx.launch.options import Chaos
    from phalanx.protocol.status import Status
    from phalanx.track.job import JobTracking


class ReplicaOps:
    """Mixed into :class:`~phalanx.launch.local.LocalJob`; called with its lock held."""

    replicas: dict[str, Replica]
    rl: bool
    chaos: Chaos | None
    tracking: JobTracking | None
    _rng: random.Random

    if TYPE_CHECKING:  # LocalJob's

        def status(self) -> Status | None: ...

        def start_replica(self, r: Replica) -> None: ...

        def note(self, text: str) -> None: ...

    # -- scale -----------------------------------------------------------

    def _follow_desired(self, now: float) -> None:
        """Start or stop replicas so that each role has the count ``phalanx scale`` set."""
        st = self.status()
        if st is None:
            return
        for role, info in st.roles.items():
            want = info.desired
            if want is None:
                continue
            active = sorted(
                (r for r in self.replicas.values() if r.role == role and r.retiring_since is None),
                key=lambda r: r.index,
            )
            for _ in range(want - len(active)):
                i = next(
                    i for i in range(len(self.replicas) + 1) if f"{role}-{i}" not in self.replicas
                )
                r = self.replicas[f"{role}-{i}"] = Replica(f"{role}-{i}", role)
                self.start_replica(r)
                self.note(f"{r.name} started (scale {role} to {want})")
            for r in active[want:]:
                r.retiring_since = now
                r.restart_at = None
                signal_proc(r.proc, signal.SIGTERM)
                self.note(f"{r.name}: stopping (scale {role} to {want})")

    # -- chaos -----------------------------------------------------------

    def _kill_one(self) -> bool:
        """SIGKILL a random replica, but only when every replica is up and has made
        progress since its start, so that at most one is down at a time. An FT job
        also needs two: a healthy peer must hold the job's state (policy replicas of
        an RL job resume from their state file instead). True when it killed one."""
        reps = [r for r in self.replicas.values() if r.retiring_since is None and not r.done]
        alive = [r for r in reps if r.running and r.progress]
        if not reps or len(alive) < len(reps) or (not self.rl and len(alive) < 2):
            return False
        r = self._rng.choice(alive)
        assert r.proc is not None
        signal_proc(r.proc, signal.SIGKILL)
        r.proc.wait()
        r.proc = None
        r.kills += 1
        if self.tracking is not None:
            self.tracking.killed()
        assert self.chaos is not None
        r.restart_at = time.monotonic() + self.chaos.restart_after_s
        what = f"step {r.step}" if r.role == "policy" else f"{r.rollouts} rollouts"
        self.note(f"chaos: SIGKILL {r.name} at {what}")
        return True

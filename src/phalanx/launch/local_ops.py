"""What an operator does to a local job's replica set, beside its supervision
(:mod:`phalanx.launch.local`): follow the counts ``phalanx scale`` asks for. (What
``--chaos`` does is in :mod:`phalanx.launch.chaos`.)"""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from phalanx.launch.procs import signal_proc
from phalanx.launch.replica import Replica

if TYPE_CHECKING:
    from phalanx.protocol.status import Status


class ReplicaOps:
    """Mixed into :class:`~phalanx.launch.local.LocalJob`; called with its lock held."""

    replicas: dict[str, Replica]
    rl: bool

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

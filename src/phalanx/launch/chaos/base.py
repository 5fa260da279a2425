"""What the chaos runner needs of the launcher whose job it disturbs: its replicas
and their process handles, its lock, its controllers and its notes. The local
launcher (:class:`~phalanx.launch.local.LocalJob`, and the Ray launcher built on
it) provides all of it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from phalanx.config import JobConfig
    from phalanx.launch.controllers.base import Controllers
    from phalanx.launch.replica import Replica
    from phalanx.track.job import JobTracking


class ChaosTarget(Protocol):
    """Who calls: the chaos runner, from the launcher's loop thread and its own slow
    thread. ``replicas`` and each replica's ``proc`` are read and changed with
    ``lock`` held only."""

    cfg: JobConfig
    rl: bool
    run_dir: Path
    replicas: dict[str, Replica]
    lock: threading.Lock
    controller: Controllers | None
    tracking: JobTracking | None
    gids: dict[str, int] | None
    """Each replica's group id of its own (:mod:`.partition`), given as it starts; None
    when this launcher does not give them (no partitions asked for, or replicas
    started elsewhere: Ray)."""

    def note(self, text: str) -> None:
        """A line in the run's output."""
        ...

    def finished(self) -> bool: ...

"""Every chaos fault, written twice: a ``chaos: ...`` line in the run's output (as
the operator reads it), and one JSON object per line in ``RUN_DIR/chaos.jsonl``
(as an audit reads it, to line faults up with the job's timeline)::

    {"t": 1767000000.25, "kind": "stop", "target": "policy-1", "pid": 4242,
     "detail": {"step": 14, "stop_s": 3.1}}

``t`` is wall-clock seconds (``time.time()``: the timeline's clock), ``kind`` one
of :data:`~phalanx.launch.chaos.spec.KINDS` (``slow`` once per process slowed),
``target`` the replica's name (``controller`` or ``controller-1`` for a
controller), ``pid`` the process signalled (the replica's process group leader,
or the engine worker's own pid), ``detail`` what else the fault had.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

FILE = "chaos.jsonl"


class ChaosLog:
    """Who calls: the launcher's loop and the slow thread; each call writes whole lines."""

    def __init__(self, run_dir: Path, note: Callable[[str], None]):
        self.path = run_dir / FILE
        self.note = note
        self.counts: dict[str, int] = {}
        """Faults delivered so far, per kind."""
        self._lock = threading.Lock()

    def fault(self, kind: str, target: str, pid: int | None, text: str, **detail: Any) -> None:
        """Record one fault: ``text`` is the operator's line (after ``chaos: ``)."""
        line = json.dumps(
            {
                "t": round(time.time(), 3),
                "kind": kind,
                "target": target,
                "pid": pid,
                "detail": detail,
            }
        )
        with self._lock:
            with self.path.open("a") as f:
                f.write(line + "\n")
            self.counts[kind] = self.counts.get(kind, 0) + 1
        self.note(f"chaos: {text}")


def read(run_dir: Path) -> list[dict[str, Any]]:
    """The faults of a run, in the order they were delivered (none: [])."""
    path = run_dir / FILE
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]

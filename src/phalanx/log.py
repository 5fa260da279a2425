"""Log lines that say who and when: ``[policy/replica-2:3f1a rank 0 | step 41 | q 7]``."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any


@dataclass
class Who:
    """Mutable identity of a replica process, read at each log call."""

    role: str = "-"
    replica_id: str = "-"
    rank: int = 0
    step: int | None = None
    quorum_id: int | None = None

    def prefix(self) -> str:
        parts = [f"{self.role}/{self.replica_id} rank {self.rank}"]
        if self.step is not None:
            parts.append(f"step {self.step}")
        if self.quorum_id is not None:
            parts.append(f"q {self.quorum_id}")
        return "[" + " | ".join(parts) + "]"


class ReplicaLogger(logging.LoggerAdapter):
    def __init__(self, logger: logging.Logger, who: Who):
        super().__init__(logger, {})
        self.who = who

    def process(self, msg, kwargs):
        return f"{self.who.prefix()} {msg}", kwargs


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to ``sys.stderr`` as it is when a record comes, not as it was at
    :func:`setup`: a process that replaces it later (a redirection, a test's
    capture that is then closed) gets its logs where its errors go."""

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _value: Any) -> None:
        pass


def setup(level: int = logging.INFO) -> None:
    """Plain timestamped logs on stderr; idempotent."""
    root = logging.getLogger("phalanx")
    if root.handlers:
        return
    h = _Stderr()
    h.setFormatter(
        logging.Formatter("%(asctime)s.%(msecs)03d %(levelname).1s %(message)s", "%H:%M:%S")
    )
    root.addHandler(h)
    root.setLevel(level)

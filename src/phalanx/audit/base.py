"""What the audit's checks share: a check's result, and a run directory as read.

A check never raises on what it finds: every finding is a line of
:attr:`Check.problems`, and a check with any problem is a violation. Only a
directory that is not a run at all raises (:class:`NotARun`), in one line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PASS, FAIL, SKIP = "pass", "FAIL", "skip"
"""Verdicts. ``skip``: the check does not apply to this run (it says why); it is not
a violation."""

SHOWN_PROBLEMS = 3
"""Problems a check's detail names; the rest are counted."""


class NotARun(ValueError):
    """The directory is not a ``phalanx run`` directory; the message is one line that
    names what is missing."""


@dataclass
class Check:
    """One audited property of a run."""

    name: str
    """Short name (the table's first column), e.g. ``steps.once``."""
    what: str
    """What it established when it passed (the detail of a pass)."""
    problems: list[str] = field(default_factory=list)
    """Each violation found, one line each; empty when the check passed."""
    skipped: str | None = None
    """Why the check does not apply to this run (None: it ran)."""

    @property
    def verdict(self) -> str:
        if self.skipped is not None:
            return SKIP
        return FAIL if self.problems else PASS

    @property
    def detail(self) -> str:
        if self.skipped is not None:
            return self.skipped
        if not self.problems:
            return self.what
        more = len(self.problems) - SHOWN_PROBLEMS
        text = "; ".join(self.problems[:SHOWN_PROBLEMS])
        return text + (f"; and {more} more" if more > 0 else "")

    def as_dict(self) -> dict[str, Any]:
        return {
            "check": self.name,
            "verdict": self.verdict,
            "detail": self.detail,
            "problems": self.problems,
        }


@dataclass
class Rollback:
    """An explicit rollback of the policy's step, as the controller journaled it: the
    quorum ``quorum_id`` went back from ``from_step`` to ``to_step``."""

    quorum_id: int
    from_step: int
    to_step: int


@dataclass
class Run:
    """A run directory as the audit reads it (:func:`phalanx.audit.rundir.load_run`)."""

    path: Path
    config: Any
    """The resolved :class:`~phalanx.config.JobConfig` (``controller/config.json``)."""
    events: dict[str, list[dict[str, Any]]]
    """The JSON events of each replica's log, by log name (``policy-0``), in order."""
    finals: list[Path]
    """``final/*.safetensors``, by name."""
    journal: dict[str, dict[str, dict[str, Any]]] | None
    """The controller journal's tables (None: the journal is not in the run dir, as
    with an etcd journal outside it)."""
    rollbacks: list[Rollback] = field(default_factory=list)
    """The policy's explicit rollbacks, oldest first (from the journal)."""
    committed_step: int | None = None
    """The policy's step as the journal holds it (None: no journal)."""

    @property
    def rl(self) -> bool:
        return self.config.rl is not None

    def steps(self) -> list[dict[str, Any]]:
        """Every committed-step line of the policy, log by log, in each log's order
        (``_log``: the log it came from)."""
        out = []
        for log, evs in sorted(self.events.items()):
            for e in evs:
                if e.get("event") == "step" and e.get("role", "policy") == "policy":
                    out.append({**e, "_log": log})
        return out

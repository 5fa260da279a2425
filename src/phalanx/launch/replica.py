"""What the launcher knows of one replica: its process, and what its JSON lines
said (one object per line on stdout; lines that are not JSON are ignored).

Lines of a policy replica: ``start``, ``step`` (committed step, with the batch's
reward and exact match in an RL job), ``sync``, ``retry`` and ``done``; of a
rollout replica: ``start``, ``rollout`` (one submitted lease), ``sync`` and ``done``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from phalanx.launch.procs import Proc


@dataclass
class Replica:
    name: str
    """``ROLE-INDEX``; the index orders scale-downs (highest first)."""
    role: str = "policy"
    proc: Proc | None = None
    replica_id: str = ""
    starts: int = 0
    kills: int = 0
    heals: int = 0
    retries: int = 0
    failed_starts: int = 0
    """Exits in a row with no progress since their start."""
    done: bool = False
    restart_at: float | None = None
    retiring_since: float | None = None
    """Set when a scale-down asked this replica to stop (SIGTERM sent then)."""
    progress: bool = False
    """Made progress since its latest start: a committed step, or a submitted rollout."""
    step: int = 0
    version: int | None = None
    loss: float | None = None
    top: tuple[int, float | None] = (0, None)
    """The highest step any incarnation of this replica committed, and its loss (kept
    across restarts, which reset ``step`` and ``loss``): what a summary reports."""
    participants: int = 0
    quorum_id: int = 0
    reward: float | None = None
    exact_match: float | None = None
    staleness: int | None = None
    rollouts: int = 0
    stale: int = 0
    duplicates: int = 0
    syncs: int = 0
    relayed: int = 0
    """Syncs this rollout replica was the source of (it relayed its weights)."""
    sync_ms: list[float] = field(default_factory=list)
    idle: list[float] = field(default_factory=list)
    """The ``idle`` of each RL ``step`` line (policy) or ``rollout`` line: the fraction
    of that step's or generation batch's wall time spent waiting (:mod:`phalanx.rl.idle`)."""
    tokens_per_s: list[float] = field(default_factory=list)
    """A training job's committed tokens per second, per step line (your model)."""
    mfu: float | None = None
    peak_mem_mb: float | None = None
    val_loss: float | None = None
    val_step: int = -1
    """The step whose line last gave ``val_loss``."""
    last: dict[str, Any] = field(default_factory=dict)

    @property
    def index(self) -> int:
        return int(self.name.rsplit("-", 1)[1])

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def state(self) -> str:
        if self.done:
            return "done"
        if self.proc is None:
            return "down"
        return "stopping" if self.retiring_since is not None else str(self.proc.pid)

    def started(self) -> None:
        """A new process (incarnation) of this replica was started."""
        self.starts += 1
        self.done, self.progress, self.restart_at = False, False, None
        self.step, self.loss, self.participants = 0, None, 0

    def apply(self, ev: dict[str, Any], quiet_sync_failures: bool = False) -> str | None:
        """Take in one JSON line. Returns a note worth showing, if any."""
        self.last = ev
        self.replica_id = ev.get("replica", self.replica_id)
        kind = ev.get("event")
        if isinstance(ev.get("idle"), int | float) and kind in ("step", "rollout"):
            self.idle.append(float(ev["idle"]))
        if kind == "step":
            self.progress, self.failed_starts = True, 0
            self.step, self.loss = ev.get("step", self.step), ev.get("loss")
            if self.step >= self.top[0] and self.loss is not None:
                self.top = (self.step, self.loss)
            self.participants = ev.get("participants", 0)
            self.quorum_id = ev.get("quorum_id", 0)
            for k in ("version", "reward", "exact_match", "staleness", "mfu", "val_loss"):
                if k in ev:
                    setattr(self, k, ev[k])
            if "val_loss" in ev:
                self.val_step = int(ev.get("step", self.step))
            if "tokens_per_s" in ev:
                self.tokens_per_s.append(float(ev["tokens_per_s"]))
            if "peak_mem_mb" in ev:
                self.peak_mem_mb = max(self.peak_mem_mb or 0.0, float(ev["peak_mem_mb"]))
            if ev.get("healed"):
                self.heals += 1
                return f"{self.name} healed to step {self.step}"
        elif kind == "rollout":
            self.progress, self.failed_starts = True, 0
            self.rollouts += ev.get("accepted", 0)
            self.stale += ev.get("stale", 0)
            self.duplicates += ev.get("duplicate", 0)
            for k in ("version", "reward", "exact_match"):
                if k in ev:
                    setattr(self, k, ev[k])
        elif kind == "sync":
            if ev.get("ok"):
                self.syncs += 1
                self.relayed += self.role == "rollout" and ev.get("source") == ev.get("replica")
                self.version = ev.get("version", self.version)
                if isinstance(ev.get("ms"), int | float):
                    self.sync_ms.append(float(ev["ms"]))
            elif not quiet_sync_failures:
                return f"{self.name}: weight sync to v{ev.get('version')} failed"
        elif kind == "retry":
            self.retries += 1
            return f"{self.name}: step {ev.get('step')} not committed; retrying"
        elif kind == "done":
            self.done = True
            if ev.get("drained"):
                return f"{self.name} drained: left the job" + (
                    f" at step {ev['step']}" if "step" in ev else ""
                )
        return None

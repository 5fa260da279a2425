"""A job's metrics, logged once, whatever its kind and whoever launched it.

- **Training jobs** (FT-DDP, HSDP, sync DiLoCo, decoupled DiLoCo) have no
  ledger: each replica prints one JSON line per committed step (``step``; a
  decoupled DiLoCo slot, one ``round`` line per outer round), and every
  replica that took part prints it. The writer reads the lines of every
  replica it sees and logs each step once, at the first line of it to arrive,
  with every numeric field that line carries (:func:`step_metrics`) as
  ``train/<name>``, and two counters of the job's life so far: ``job/heals``
  (replicas that healed from a peer before a step) and ``job/kills`` (replica
  processes the writer saw die: SIGKILLed by ``--chaos``, or exited with a
  failure).
- **RL jobs**: the ledger's trained batches, from the controller's status
  (:func:`~phalanx.track.base.batch_metrics`), each once, with ``job/kills``.

Steps only grow: a line of a step at or before the last one logged (a late
replica, a rollback's repeated steps) is not logged again.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from phalanx.config import JobConfig
from phalanx.protocol.status import Status
from phalanx.track.base import Trackers, batch_metrics
from phalanx.track.trackers import trackers

BOOKKEEPING = frozenset(
    {"t", "step", "round", "inner_step", "cursor", "quorum_id", "data_step", "fragment", "ranks"}
)
"""Numeric fields of a step line that index or place the step rather than measure
it: not logged (the step itself is the tracker's step)."""
STEP_EVENTS = {"step": "step", "round": "round"}
"""The lines that say a step committed, and the field that numbers it."""


def step_metrics(line: Mapping[str, Any]) -> dict[str, float]:
    """The numeric fields of a step line (not booleans, not :data:`BOOKKEEPING`) as
    ``train/<name>`` scalars; a field the replicas add later is logged as it comes."""
    return {
        f"train/{k}": float(v)
        for k, v in line.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and k not in BOOKKEEPING
    }


class JobTracking:
    """The one writer of a job's metrics (module doc). Who calls: the launcher (or
    agent, or Ray driver) that reads the replicas' lines, from one thread at a time."""

    def __init__(self, sink: Trackers, rl: bool = False):
        self.sink = sink
        self.rl = rl
        self.heals = 0
        self.kills = 0
        self._healed: set[tuple[str, int]] = set()

    @classmethod
    def start(cls, cfg: JobConfig, run_dir: Path, name: str | None = None) -> JobTracking:
        """The trackers ``cfg.track`` asks for, writing under ``run_dir``. Raises
        ValueError in one line when one cannot start."""
        sink = trackers(cfg.track, run_dir, name or run_dir.name, cfg.dump(), cfg.job.id)
        return cls(sink, rl=cfg.rl is not None)

    def line(self, ev: Mapping[str, Any]) -> None:
        """One JSON line of a replica: a committed step is logged if it is new."""
        key = STEP_EVENTS.get(str(ev.get("event")))
        if self.rl or key is None or not isinstance(ev.get(key), int):
            return
        step = int(ev[key])
        if ev.get("healed") is True and (str(ev.get("replica")), step) not in self._healed:
            self._healed.add((str(ev.get("replica")), step))
            self.heals += 1
        if step <= self.sink.last_step:
            return
        metrics = {**step_metrics(ev), "job/heals": self.heals, "job/kills": self.kills}
        wall = ev.get("t")
        self.sink.log(step, metrics, float(wall) if isinstance(wall, int | float) else None)

    def killed(self) -> None:
        """A replica process died (``job/kills`` from the next step on)."""
        self.kills += 1

    def status(self, st: Status | None) -> None:
        """An RL job's batches trained since the last call, from the controller's status."""
        if not self.rl or st is None or st.rl is None:
            return
        discarded = st.rl.rollouts.discarded
        for rec in st.rl.history:
            if rec.batch > self.sink.last_step:
                # At the controller's time of the batch's ack, not of this poll.
                metrics = {**batch_metrics(rec, discarded), "job/kills": float(self.kills)}
                self.sink.log(rec.batch, metrics, rec.at)

    def close(self) -> None:
        self.sink.close()

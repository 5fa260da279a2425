"""The job's metrics under the agent (``phalanx agent --track --config JOB``).

Every node of a job runs an agent, and each sees only its own replica's
workers: so one agent of the job, and only one, is given ``--track`` (the
operator picks it; of node rank 0 for a replica across nodes, whose rank 0
prints the step lines). It writes ``[track]``'s trackers under its run dir:

- a training job: it reads its rank 0's JSON lines (``gen{G}/rank0.out``, every
  generation in turn) and logs each committed step of its replica once
  (:class:`~phalanx.track.job.JobTracking`). Every participant of a step prints
  it, so the steps missing are only those its own replica was not part of
  (down, or healing); ``job/kills`` counts its own workers' failures.
- an RL job: the ledger's trained batches, from the status of ``--controller``,
  as ``phalanx run`` logs them: every batch once, whichever replicas trained it
  (any agent will do, one that serves the controller only included).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from phalanx.track.job import JobTracking

EVERY_S = 0.5
"""How often the agent reads new lines (and, for RL, the controller's status)."""


class AgentTrack:
    """Who calls: the agent's main loop (:meth:`poll` as often as it likes,
    :meth:`killed` on a worker failure, :meth:`close` once at the end). Raises
    ValueError in one line when the config cannot be read or a tracker cannot start."""

    def __init__(self, config: str, run_dir: Path, controller: str | None, workers: bool = True):
        from phalanx.config import ConfigError, load_config

        try:
            cfg = load_config(config)
        except ConfigError as e:
            raise ValueError(str(e)) from None
        if cfg.rl is not None and not controller:
            raise ValueError(
                "--track of an RL job logs the ledger from the controller's status: pass "
                "--controller too."
            )
        if cfg.rl is None and not workers:
            raise ValueError(
                "--track of a training job logs its replica's step lines: give it to an agent "
                "that runs a replica, not to one that serves the controller only."
            )
        self.tracking = JobTracking.start(cfg, run_dir, name=f"{cfg.job.id}-{run_dir.name}")
        self.controller = controller
        self.run_dir = run_dir
        self.generation = 0
        """The generation whose lines are read now (earlier ones are read through)."""
        self.offset = 0
        self._next_at = 0.0

    def poll(self, generation: int, force: bool = False) -> None:
        """Log what is new, at most every :data:`EVERY_S` unless ``force``."""
        now = time.monotonic()
        if not force and now < self._next_at:
            return
        self._next_at = now + EVERY_S
        if self.tracking.rl:
            self._status()
            return
        while True:
            self._read(self.run_dir / f"gen{self.generation}" / "rank0.out")
            if self.generation >= generation:
                return
            self.generation, self.offset = self.generation + 1, 0

    def _read(self, path: Path) -> None:
        try:
            with path.open("rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return  # not started yet
        done = data.rfind(b"\n") + 1  # whole lines only: the rest is still being written
        self.offset += done
        for raw in data[:done].splitlines():
            if raw.startswith(b"{"):
                try:
                    ev = json.loads(raw)
                except ValueError:
                    continue
                if isinstance(ev, dict):
                    self.tracking.line(ev)

    def _status(self) -> None:
        from phalanx.client import ControllerError
        from phalanx.console.poll import fetch_status

        assert self.controller is not None  # checked in __init__
        try:
            self.tracking.status(fetch_status(self.controller, timeout_s=5.0))
        except ControllerError:
            pass  # down for a moment: the ledger keeps the batches for the next poll

    def killed(self) -> None:
        self.tracking.killed()

    def close(self, generation: int) -> None:
        self.poll(generation, force=True)
        self.tracking.close()

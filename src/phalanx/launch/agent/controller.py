"""The agent's link to the job's controller: it reports its replica's failures
there at once (so that the quorum moves on without waiting for a heartbeat
timeout), and with ``--serve-controller`` it runs the controller itself and
starts it again, on the same state dir and port, when it dies."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phalanx.launch.agent.options import AgentOptions
from phalanx.launch.report import controller_problem, report_exit
from phalanx.launch.supervise import ControllerProcess

CHECK_S = 0.2
"""How often a served controller's process is checked."""


class ControllerLink:
    """Who calls: the agent's main loop, which passes its ``emit`` (an event line)
    and ``note`` (a log line) for this to speak through."""

    def __init__(
        self,
        opts: AgentOptions,
        emit: Callable[..., None],
        note: Callable[[str, int], None],
    ):
        self.opts, self.emit, self.note = opts, emit, note
        self.process: ControllerProcess | None = None
        """The job's controller, when this agent serves it (``--serve-controller``)."""
        self._checked_at = 0.0

    def serve(self) -> None:
        """Start the job's controller, when this agent serves it."""
        args, state = self.opts.serve_controller, self.opts.controller
        if args is None or state is None:
            return
        self.process = ControllerProcess(
            Path(state), list(args), self.opts.run_dir / "controller.log"
        )
        url = self.process.start()
        self.emit("controller", url=url, pid=self.process.pid())
        self.note(f"controller at {url}", logging.INFO)

    def check_process(self) -> None:
        """Start the served controller again if it died (at most every CHECK_S)."""
        now = time.monotonic()
        if self.process is None or now - self._checked_at < CHECK_S:
            return
        self._checked_at = now
        news = self.process.check()
        if news is not None:
            self.note(news, logging.INFO)
            self.emit(
                "controller_restart",
                restarts=self.process.restarts,
                pid=self.process.pid(),
                note=news,
            )

    def warn_if_unreachable(self) -> None:
        """Say at once, not at the first failure, when exits cannot be reported."""
        problem = controller_problem(self.opts.controller)
        if problem is not None:
            self.note(
                f"worker exits cannot be reported to the controller: {problem}", logging.WARNING
            )

    def report(self, reason: str) -> None:
        """Evict the replica's live incarnation(s) at the controller (see
        :func:`~phalanx.launch.report.report_exit`)."""
        if not self.opts.controller:
            return
        ids, error = report_exit(self.opts.controller, self.opts.name, reason)
        fields: dict[str, Any] = {"replica_ids": ids, "reason": reason}
        if error is not None:
            self.emit("reported", **fields, error=error)
            self.note(f"could not report to the controller: {error}", logging.WARNING)
            return
        self.emit("reported", **fields)

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()

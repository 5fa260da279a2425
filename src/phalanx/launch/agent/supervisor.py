"""``phalanx agent``: the elastic agent, one per node and replica.

It launches the worker processes (ranks) of one replica on this node with a
torchrun-style environment (:func:`phalanx.launch.agent.options.worker_env`)
and watches them:

- **A worker fails** (non-zero exit or a signal): the agent reports it to the
  controller at once, by deregistering the replica's live incarnation, so that
  the quorum moves on without waiting for a heartbeat timeout. It stops the
  replica's other workers (their process group is broken), waits
  ``backoff_s * 2**k`` (capped), and starts them all again on a fresh
  ``MASTER_PORT``, up to ``max_restarts`` times; past that it exits 1. The new
  incarnation registers again and heals from a peer (or resumes from the
  latest checkpoint).
- **The layout must change**, on an operator's request (``phalanx agent
  resize``) or because one slot's worker keeps failing first (a lost device,
  when ``--min-nproc`` allows fewer workers): 1. the workers get SIGTERM and
  checkpoint their current step (one that does not exit within the grace is
  SIGKILLed, and the latest committed checkpoint counts); 2. they start again
  with the new ``WORLD_SIZE``; 3. they reshard-load that checkpoint; 4. they
  rejoin the job.
- **All workers exit 0**: the job is done; the agent exits 0.
- **The agent gets SIGTERM or SIGINT**: it stops its workers (SIGTERM, then
  SIGKILL after the grace) and exits 128 + the signal.

Every event is one JSON line on stdout (``start``, ``worker_exit``,
``reported``, ``stopped``, ``restart``, ``layout``, ``resize_ignored``,
``resize_refused``, ``done``, ``failed``); human logs go to stderr. Workers run
in their own process groups and are signalled by pid, never by name.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from phalanx.jobs.base import EXIT_UNRECOVERABLE
from phalanx.launch.agent.files import PID_FILE, read_pid, take_resize, write_atomic
from phalanx.launch.agent.options import (
    AgentOptions,
    backoff_delay,
    latest_step,
    options_from_args,
)
from phalanx.launch.agent.workers import AgentError, Worker, start_workers
from phalanx.launch.procs import last_line, signal_proc, stop_all
from phalanx.launch.report import controller_problem, report_exit
from phalanx.launch.supervise import ControllerDown, ControllerProcess

log = logging.getLogger("phalanx.agent")


class Agent:
    """Runs and supervises one replica's workers on this node; see the module doc.

    Call :meth:`run` once, from the main thread (it installs signal handlers
    for SIGTERM, SIGINT and SIGHUP; elsewhere only :meth:`stop` and
    :meth:`request_resize` steer it)."""

    poll_s = 0.02

    def __init__(self, opts: AgentOptions, out: TextIO | None = None):
        self.opts = opts.check()
        self.out = out or sys.stdout
        self.slots = list(range(opts.nproc))
        self.workers: list[Worker] = []
        self.generation = -1
        self.restarts = 0
        """Restarts after failures so far (layout changes asked for are not counted)."""
        self.first_failures: dict[int, int] = {}
        """Slot -> times in a row its worker was the first of the replica to fail."""
        self._stop_signal: int | None = None
        self._resize = threading.Event()
        self.controller: ControllerProcess | None = None
        """The job's controller, when this agent serves it (``--serve-controller``)."""
        self._checked_at = 0.0

    # -- outputs ---------------------------------------------------------

    def emit(self, event: str, **fields: Any) -> None:
        rec = {"event": event, "agent": self.opts.name, "t": round(time.time(), 3), **fields}
        try:
            self.out.write(json.dumps(rec) + "\n")
            self.out.flush()
        except OSError:
            pass  # whoever read our stdout is gone; the workers still need supervising

    def note(self, msg: str, level: int = logging.INFO) -> None:
        log.log(
            level, "[agent %s@%s | gen %d] %s", self.opts.name, self.opts.node, self.generation, msg
        )

    # -- steering (signal handlers, other threads) -------------------------

    def stop(self, signum: int = signal.SIGTERM) -> None:
        self._stop_signal = signum

    def request_resize(self) -> None:
        """A resize request is waiting in the run dir (what SIGHUP means)."""
        self._resize.set()

    # -- main loop -------------------------------------------------------

    def run(self) -> int:
        """Supervise until the job is done (0), the restarts are spent (1), or the
        agent is stopped (128 + signal). The workers are stopped on every way out."""
        rd = self.opts.run_dir
        rd.mkdir(parents=True, exist_ok=True)
        other = read_pid(rd)
        if other is not None and other != os.getpid():
            raise AgentError(
                f"the run dir must belong to one agent: got {rd}, where agent pid {other} "
                f"runs. Stop it, or pass another --run-dir."
            )
        old = self._install_signals()  # before the pid file: SIGHUP would kill us
        write_atomic(rd / PID_FILE, str(os.getpid()))
        try:
            self._serve_controller()
            return self._supervise()
        except ControllerDown as e:
            self.emit("failed", reason=str(e))
            self.note(str(e), logging.ERROR)
            return 1
        finally:
            stop_all([w.proc for w in self.workers], self.opts.grace_s)
            if self.controller is not None:
                self.controller.stop()
            for sig, handler in old.items():
                signal.signal(sig, handler)
            if read_pid(rd) == os.getpid():
                (rd / PID_FILE).unlink(missing_ok=True)

    def _install_signals(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        old: dict[int, Any] = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            old[sig] = signal.signal(sig, lambda s, f: self.stop(s))
        old[signal.SIGHUP] = signal.signal(signal.SIGHUP, lambda s, f: self.request_resize())
        return old

    def _serve_controller(self) -> None:
        """Start the job's controller, when this agent serves it."""
        args, state = self.opts.serve_controller, self.opts.controller
        if args is None or state is None:
            return
        self.controller = ControllerProcess(
            Path(state), list(args), self.opts.run_dir / "controller.log"
        )
        url = self.controller.start()
        self.emit("controller", url=url, pid=self.controller.pid())
        self.note(f"controller at {url}")

    def _check_controller_process(self) -> None:
        """Start the served controller again if it died (at most every 0.2 s)."""
        now = time.monotonic()
        if self.controller is None or now - self._checked_at < 0.2:
            return
        self._checked_at = now
        news = self.controller.check()
        if news is not None:
            self.note(news)
            self.emit(
                "controller_restart",
                restarts=self.controller.restarts,
                pid=self.controller.pid(),
                note=news,
            )

    def _supervise(self) -> int:
        if self.opts.controller_only:
            while self._stop_signal is None:
                self._check_controller_process()
                time.sleep(self.poll_s)
            return self._stopped()
        self._check_controller()
        self._start("initial")
        while True:
            what = self._watch()
            if what == "done":
                self.emit("done", generation=self.generation, restarts=self.restarts)
                self.note("all workers exited 0: done")
                return 0
            if what == "stop":
                return self._stopped()
            if what == "resize":
                self._apply_resize()
                continue
            assert isinstance(what, Worker)
            code = self._on_failure(what)
            if code is not None:
                return code

    def _watch(self) -> Worker | str:
        """Block until something needs the agent: "stop", "resize", "done" (every
        worker exited 0), or the worker that failed (killed-by-signal first)."""
        while True:
            if self._stop_signal is not None:
                return "stop"
            if self._resize.is_set():
                return "resize"
            self._check_controller_process()
            codes = [w.proc.poll() for w in self.workers]
            failed = [w for w, c in zip(self.workers, codes, strict=True) if c not in (None, 0)]
            if failed:
                return min(failed, key=lambda w: (w.proc.returncode >= 0, w.rank))
            if all(c == 0 for c in codes):
                return "done"
            time.sleep(self.poll_s)

    def _sleep(self, seconds: float) -> bool:
        """Sleep, but wake for a stop. False if the agent was stopped meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self._stop_signal is not None:
                return False
            time.sleep(min(self.poll_s, max(0.0, deadline - time.monotonic())))
        return self._stop_signal is None

    # -- workers ---------------------------------------------------------

    def _start(self, reason: str) -> None:
        self.generation += 1
        self.workers, record = start_workers(
            self.opts, self.slots, self.generation, self.restarts, reason
        )
        self.emit("start", **record)
        self.note(f"started {record['nproc']} worker(s) ({reason}); logs in {record['dir']}")

    def _stop_workers(self, grace_s: float) -> list[dict[str, Any]]:
        """SIGTERM every running worker, SIGKILL those still alive after ``grace_s``.
        Returns how each one ended."""
        running = [w for w in self.workers if w.proc.poll() is None]
        stop_all([w.proc for w in running], grace_s)
        return [
            {"rank": w.rank, "pid": w.pid, "code": w.proc.returncode, "exit": w.describe()}
            for w in running
        ]

    # -- failures --------------------------------------------------------

    def _on_failure(self, w: Worker) -> int | None:
        """A worker failed: report, stop the rest, back off, restart. Returns an
        exit code when the agent must stop instead."""
        what = f"worker rank {w.rank} (pid {w.pid}) {w.describe()}"
        self.emit(
            "worker_exit",
            generation=self.generation,
            rank=w.rank,
            slot=w.slot,
            pid=w.pid,
            code=w.proc.returncode,
            exit=w.describe(),
        )
        self.note(what, logging.WARNING)
        others = [x for x in self.workers if x is not w and x.proc.poll() is None]
        for x in others:  # before the report: a live rank 0 must not re-register
            signal_proc(x.proc, signal.SIGTERM)
        self._report(f"{what} (reported by agent {self.opts.node})")
        stopped = self._stop_workers(self.opts.fail_grace_s)
        self.emit("stopped", generation=self.generation, workers=stopped)
        count = self.first_failures.get(w.slot, 0) + 1
        self.first_failures = {w.slot: count}
        if w.proc.returncode == EXIT_UNRECOVERABLE:  # it said why; a restart cannot help
            said = last_line(w.out.with_suffix(".err"), last_line(w.out, "no message"))
            msg = f"replica {self.opts.name}: worker rank {w.rank} cannot run: {said}"
            self.emit("failed", error=msg, restarts=self.restarts)
            self.note(msg, logging.ERROR)
            return 1
        if self.restarts >= self.opts.max_restarts:
            msg = (
                f"replica {self.opts.name}: {what}, and the agent has used all "
                f"--max-restarts {self.opts.max_restarts}; giving up. See {w.out} and "
                f"{w.out.with_suffix('.err')}."
            )
            self.emit("failed", error=msg, restarts=self.restarts)
            self.note(msg, logging.ERROR)
            return 1
        delay = backoff_delay(self.restarts, self.opts.backoff_s, self.opts.backoff_max_s)
        self.restarts += 1
        if count >= self.opts.lost_slot_after and len(self.slots) > self.opts.floor:
            why = f"slot {w.slot} lost: its worker failed first {count} times in a row"
            self._layout([s for s in self.slots if s != w.slot], why, [])
        self.emit(
            "restart",
            restart=self.restarts,
            max_restarts=self.opts.max_restarts,
            delay_s=delay,
            nproc=len(self.slots),
            reason="failure",
        )
        self.note(f"restart {self.restarts}/{self.opts.max_restarts} in {delay:.2f} s")
        if not self._sleep(delay):
            return self._stopped()
        if self._resize.is_set():
            self._apply_resize(restarting=True)  # with the layout asked for meanwhile
        else:
            self._start("failure")
        return None

    def _check_controller(self) -> None:
        """Say at once, not at the first failure, when exits cannot be reported."""
        problem = controller_problem(self.opts.controller)
        if problem is not None:
            self.note(
                f"worker exits cannot be reported to the controller: {problem}", logging.WARNING
            )

    def _report(self, reason: str) -> None:
        """Evict the replica's live incarnation(s) at the controller (see
        :func:`~phalanx.launch.report.report_exit`)."""
        if not self.opts.controller:
            return
        ids, error = report_exit(self.opts.controller, self.opts.name, reason)
        if error is not None:
            self.emit("reported", replica_ids=ids, reason=reason, error=error)
            self.note(f"could not report to the controller: {error}", logging.WARNING)
            return
        self.emit("reported", replica_ids=ids, reason=reason)

    # -- layout ----------------------------------------------------------

    def _layout(self, slots: list[int], reason: str, stopped: list[dict[str, Any]]) -> None:
        self.emit(
            "layout",
            **{"from": len(self.slots)},
            to=len(slots),
            slots=slots,
            reason=reason,
            stopped=stopped,
            latest_step=latest_step(self.opts.ckpt) if self.opts.ckpt else None,
        )
        self.note(f"layout {len(self.slots)} -> {len(slots)} worker(s): {reason}")
        self.slots = slots
        self.first_failures = {}

    def _apply_resize(self, restarting: bool = False) -> None:
        """Take the operator's resize request; change the layout if it asks for
        another worker count. ``restarting``: no worker runs (a failure restart
        is due), so start them in any case."""
        self._resize.clear()
        changed = False
        try:
            n = take_resize(self.opts.run_dir)
        except ValueError as e:
            self.emit("resize_refused", error=str(e))
            self.note(f"resize refused: {e}", logging.WARNING)
            n = None
        if n is None or n == len(self.slots):
            if n is not None:
                self.emit("resize_ignored", nproc=n, reason="already the layout")
        else:
            free = (s for s in itertools.count() if s not in self.slots)
            slots = self.slots[:n] + [next(free) for _ in range(n - len(self.slots))]
            # 1. checkpoint: the workers save their current step on SIGTERM (or the
            # latest commit counts for those killed after the grace).
            stopped = self._stop_workers(self.opts.grace_s)
            self._report(
                f"layout change {len(self.slots)} -> {n} workers "
                f"(reported by agent {self.opts.node})"
            )
            self._layout(slots, "operator request", stopped)
            changed = True
        if changed or restarting:
            # 2. restart with the new layout; the workers 3. reshard-load, 4. rejoin.
            self._start("layout" if changed else "failure")

    def _stopped(self) -> int:
        sig = self._stop_signal or signal.SIGTERM
        name = signal.Signals(sig).name
        self.note(f"{name}: stopping the workers")
        stopped = self._stop_workers(self.opts.grace_s)
        if not self.opts.controller_only:
            self._report(f"agent {self.opts.node} stopped by {name}")
        self.emit("stopped", generation=self.generation, workers=stopped, signal=name)
        return 128 + sig


# -- CLI -------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    """``phalanx agent [OPTIONS] -- CMD ...`` and ``phalanx agent resize ...``."""
    from phalanx.log import setup

    opts = options_from_args(args)
    if opts is None:
        return 0  # a resize request, sent
    setup()
    try:
        return Agent(opts).run()
    except AgentError as e:
        raise SystemExit(f"phalanx agent: {e}") from None

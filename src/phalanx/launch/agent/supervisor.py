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
- **A replica across nodes** (``--nnodes``): node 0's agent leads, the others
  follow it (:mod:`phalanx.launch.agent.nodes`). A failure on any node stops
  the replica's workers on every node, and the leader starts the next
  generation everywhere; restarts are the leader's to count. Layout changes are
  refused: a replica across nodes keeps its layout.
- **All workers exit 0**: the job is done; the agent exits 0.
- **The agent gets SIGTERM or SIGINT**: it stops its workers (SIGTERM, then
  SIGKILL after the grace) and exits 128 + the signal.

Every event is one JSON line on stdout (``start``, ``worker_exit``,
``node_exit``, ``reported``, ``stopped``, ``restart``, ``layout``,
``resize_ignored``, ``resize_refused``, ``done``, ``failed``); human logs go to
stderr. With ``--track`` this agent also logs the job's metrics
(:mod:`phalanx.launch.agent.track`). Workers run
in their own process groups and are signalled by pid, never by name.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, TextIO

from phalanx.jobs.base import EXIT_UNRECOVERABLE
from phalanx.launch.agent.controller import ControllerLink
from phalanx.launch.agent.files import PID_FILE, read_pid, take_resize, write_atomic
from phalanx.launch.agent.nodes import Failure, NodeError, NodeLink, Round
from phalanx.launch.agent.options import (
    AgentOptions,
    backoff_delay,
    latest_step,
)
from phalanx.launch.agent.track import AgentTrack
from phalanx.launch.agent.workers import AgentError, Worker, start_workers
from phalanx.launch.procs import last_line, signal_proc, stop_all
from phalanx.launch.supervise import ControllerDown

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
        self.controller = ControllerLink(opts, self.emit, self.note)
        self.nodes: NodeLink | None = None
        """A replica across nodes: this agent leads it (node 0), or follows node 0's."""
        self._last_error = ""
        self.tracking: AgentTrack | None = None
        """The job's metrics, when this agent logs them (``--track``)."""

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
        o = self.opts
        if o.track:
            try:
                self.tracking = AgentTrack(o.track, rd, o.controller, workers=not o.controller_only)
            except ValueError as e:
                raise AgentError(str(e)) from None
        old = self._install_signals()  # before the pid file: SIGHUP would kill us
        write_atomic(rd / PID_FILE, str(os.getpid()))
        code = 1
        try:
            self.controller.serve()
            o = self.opts
            self.nodes = NodeLink(o.name, o.nnodes, o.nproc, o.node_rank, o.master)
            code = self._supervise()
            return code
        except (ControllerDown, NodeError) as e:
            self._last_error = str(e)
            self.emit("failed", reason=str(e))
            self.note(str(e), logging.ERROR)
            return 1
        finally:
            stop_all([w.proc for w in self.workers], self.opts.grace_s)
            if self.tracking is not None:
                self.tracking.close(self.generation)
            if self.nodes is not None:
                self.nodes.end(code, self._last_error)
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

    def _supervise(self) -> int:
        if self.opts.controller_only:
            while self._stop_signal is None:
                self.controller.check_process()
                if self.tracking is not None:
                    self.tracking.poll(self.generation)
                time.sleep(self.poll_s)
            return self._stopped()
        self.controller.warn_if_unreachable()
        if self.nodes is not None and self.nodes.follower is not None:
            code = self._follow(-1, "initial")
            if code is not None:
                return code
        else:
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
            if what == "follow":
                code = self._follow(self.generation, "node rank 0")
            elif isinstance(what, Failure):
                code = self._on_node_failure(what)
            else:
                assert isinstance(what, Worker)
                code = self._on_failure(what)
            if code is not None:
                return code

    def _watch(self) -> Worker | Failure | str:
        """Block until something needs the agent: "stop", "resize", "done" (every
        worker exited 0), the worker that failed (killed-by-signal first), another
        node's failure (the leader), or "follow": node 0 moved on (a follower)."""
        while True:
            if self._stop_signal is not None:
                return "stop"
            if self._resize.is_set():
                return "resize"
            self.controller.check_process()
            if self.tracking is not None:
                self.tracking.poll(self.generation)
            news = self.nodes.news(self.generation) if self.nodes is not None else None
            if news is not None:
                return news
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

    def _start(self, reason: str, at: Round | None = None) -> None:
        """Start the next generation's workers (``at``: node 0's, on a follower)."""
        self.generation = self.generation + 1 if at is None else at.generation
        self.workers, record = start_workers(
            self.opts, self.slots, self.generation, self.restarts, reason, at.port if at else None
        )
        if self.nodes is not None:
            self.nodes.started(self.generation, record["master_port"])
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
        self._stop_after_failure(what, w)
        count = self.first_failures.get(w.slot, 0) + 1
        self.first_failures = {w.slot: count}
        cannot_run = None
        if w.proc.returncode == EXIT_UNRECOVERABLE:  # it said why; a restart cannot help
            cannot_run = last_line(w.out.with_suffix(".err"), last_line(w.out, "no message"))
        follower = self.nodes.follower if self.nodes is not None else None
        if follower is not None:  # the leader counts restarts, and restarts every node
            follower.report(self.generation, what, cannot_run is not None)
            return self._follow(self.generation, "failure")
        if cannot_run is not None:
            return self._give_up(
                f"replica {self.opts.name}: worker rank {w.rank} cannot run: {cannot_run}"
            )
        if count >= self.opts.lost_slot_after and len(self.slots) > self.opts.floor:
            why = f"slot {w.slot} lost: its worker failed first {count} times in a row"
            self._layout([s for s in self.slots if s != w.slot], why, [])
        return self._restart(what, f"See {w.out} and {w.out.with_suffix('.err')}.")

    def _on_node_failure(self, f: Failure) -> int | None:
        """The leader: another node's worker failed in this generation. Stop this
        node's workers too, and restart the replica (every node) as for a failure here."""
        what = f"node {f.node}'s {f.reason}"
        self.emit("node_exit", generation=self.generation, node=f.node, reason=f.reason)
        self._stop_after_failure(what, None)
        if f.unrecoverable:
            return self._give_up(f"replica {self.opts.name}: {what}, which cannot run")
        return self._restart(what, f"See the logs of node {f.node}'s agent.")

    def _stop_after_failure(self, what: str, failed: Worker | None) -> None:
        self.note(what, logging.WARNING)
        if self.tracking is not None:
            self.tracking.killed()
        others = [x for x in self.workers if x is not failed and x.proc.poll() is None]
        for x in others:  # before the report: a live rank 0 must not re-register
            signal_proc(x.proc, signal.SIGTERM)
        self.controller.report(f"{what} (reported by agent {self.opts.node})")
        stopped = self._stop_workers(self.opts.fail_grace_s)
        self.emit("stopped", generation=self.generation, workers=stopped)

    def _give_up(self, msg: str) -> int:
        self._last_error = msg
        self.emit("failed", error=msg, restarts=self.restarts)
        self.note(msg, logging.ERROR)
        return 1

    def _restart(self, what: str, see: str) -> int | None:
        """Back off and start the next generation, or give up past --max-restarts."""
        if self.restarts >= self.opts.max_restarts:
            return self._give_up(
                f"replica {self.opts.name}: {what}, and the agent has used all --max-restarts "
                f"{self.opts.max_restarts}; giving up. {see}"
            )
        delay = backoff_delay(self.restarts, self.opts.backoff_s, self.opts.backoff_max_s)
        self.restarts += 1
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

    # -- a replica across nodes ------------------------------------------

    def _follow(self, after: int, reason: str) -> int | None:
        """A follower: stop this node's workers if they run, wait for node 0's
        generation newer than ``after``, and start this node's part of it. Returns
        an exit code when the agent must stop instead."""
        assert self.nodes is not None and self.nodes.follower is not None
        if any(w.proc.poll() is None for w in self.workers):
            stopped = self._stop_workers(self.opts.fail_grace_s)
            self.emit("stopped", generation=self.generation, workers=stopped)
        r = self.nodes.follower.wait(
            after, self.opts.rdzv_timeout_s, lambda: self._stop_signal is not None
        )
        if r is None:
            return self._stopped()
        if r.ended:
            why = f": {r.reason}" if r.reason else ""
            return self._give_up(f"replica {self.opts.name}: node rank 0's agent {r.state}{why}")
        self._start(reason, at=r)
        return None

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
        if self.opts.nnodes > 1:
            try:
                take_resize(self.opts.run_dir)  # consumed, whatever it asked
            except ValueError:
                pass
            self.emit("resize_refused", error="a replica across nodes keeps its layout")
            if restarting:
                self._start("failure")
            return
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
            self.controller.report(
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
            self.controller.report(f"agent {self.opts.node} stopped by {name}")
        self.emit("stopped", generation=self.generation, workers=stopped, signal=name)
        return 128 + sig

"""``phalanx run``: a whole job on this machine. It starts the controller and the
replicas (the policy replicas of an FT-DDP job; policy and rollout replicas of an
RL job) as local processes, restarts replicas that crash and a controller that
dies (on its state dir and port: the job goes on), follows the replica counts an
operator asks for with ``phalanx scale``, and can deliver chaos (``--chaos``:
replicas, controllers and engines SIGKILLed, replicas stopped or slowed, seeded and
logged: :mod:`phalanx.launch.chaos`) so that anyone can watch the job survive.
What it shows is in :mod:`phalanx.console.view`.

Every process is started in its own process group and signalled through its
pid's group; nothing is ever killed by name.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

from phalanx import env
from phalanx.client import find_token
from phalanx.config import JobConfig
from phalanx.console.poll import StatusPoller
from phalanx.console.view import View
from phalanx.jobs.base import EXIT_UNRECOVERABLE
from phalanx.launch.chaos import partition
from phalanx.launch.chaos.runner import ChaosRunner
from phalanx.launch.chaos.spec import Chaos
from phalanx.launch.controllers.base import Controllers
from phalanx.launch.controllers.group import open_controllers
from phalanx.launch.forks import Zygote, preload_for
from phalanx.launch.local_ops import ReplicaOps
from phalanx.launch.procs import Proc, last_line, signal_proc, spawn, stop_all
from phalanx.launch.replica import Replica
from phalanx.launch.supervise import ControllerDown
from phalanx.protocol.status import Status
from phalanx.track.job import JobTracking

__all__ = ["Chaos", "LocalJob", "Replica"]

RANKS = "phalanx.launch.ranks"
"""The module that starts the ranks of a replica of several (``python -m``)."""
RESTART_DELAY_S = 1.0
"""Pause before restarting a replica that exited on its own."""
MAX_FAILED_STARTS = 3
"""A replica that exits this many times in a row without progress stops the job:
it is broken (bad config, import error), and restarting it forever hides that."""


class LocalJob(ReplicaOps):
    finish_grace_s = 20.0
    """After the job finished, how long replicas get to exit by themselves."""
    stop_grace_s = 10.0
    """After a scale-down's SIGTERM, how long a replica gets before SIGKILL."""

    def __init__(
        self,
        config_path: str | None,
        cfg: JobConfig,
        run_dir: Path,
        overrides: list[str],
        replicas: int | dict[str, int],
        chaos: Chaos | None = None,
        zygote: bool = True,
        controller_host: str | None = None,
        tls: tuple[str, str] | None = None,
        controllers: int = 1,
        local_etcd: bool = False,
    ):
        self.config_path = config_path
        # Controllers on an etcd journal (one leads, the others stand by), and
        # whether the launcher runs that etcd (else the config names it).
        self.n_controllers, self.local_etcd = controllers, local_etcd
        # Where the controller binds (None: loopback), and its (certificate, key) for HTTPS.
        self.controller_host, self.tls = controller_host, tls
        self.cfg = cfg
        self.rl = cfg.rl is not None
        self.run_dir = run_dir
        self.overrides = overrides
        self.chaos = chaos
        counts = replicas if isinstance(replicas, dict) else {"policy": replicas}
        self.replicas: dict[str, Replica] = {}
        for role, n in counts.items():
            for i in range(n):
                self.replicas[f"{role}-{i}"] = Replica(f"{role}-{i}", role)
        self.retired: list[Replica] = []
        self.controller: Controllers | None = None
        self.poller: StatusPoller | None = None
        self.lock = threading.Lock()
        self.events: list[str] = []
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.commit_times: list[float] = []
        self.finished_at: float | None = None
        self.error: str | None = None
        self.dashboard: str | None = None
        """The controller's dashboard, with the job token in the URL fragment."""
        self.chaos_runner: ChaosRunner | None = None
        """Delivers ``chaos``'s faults from the loop (made at the start of :meth:`run`)."""
        drawn = chaos is not None and chaos.all_every_s is not None
        wanted = chaos is not None and (chaos.partition_every_s is not None or drawn)
        self.gids: dict[str, int] | None = (
            {} if wanted and partition.unavailable() is None else None
        )
        """Each replica's gid of its own, so that a partition can cut it off (only when
        ``chaos`` may partition: ``partition-every``, or ``all-every`` as root)."""
        self.tracking: JobTracking | None = None
        """The job's metrics, logged once (``[track]``: TensorBoard, wandb, MLflow)."""
        self.use_zygote = zygote
        self.zygote: Zygote | None = None
        """Forks the replicas with their imports done (:mod:`phalanx.launch.zygote`)."""

    # -- processes -------------------------------------------------------

    def _cfg_args(self) -> list[str]:
        return (["--config", self.config_path] if self.config_path else []) + self.overrides

    def open_controller(self) -> Controllers:
        """The job's controllers (made once, not started)."""
        if self.controller is None:
            self.controller = open_controllers(
                self.run_dir,
                self._cfg_args(),
                self.n_controllers,
                local_etcd=self.local_etcd,
                host=self.controller_host,
                tls=self.tls,
            )
        return self.controller

    def start_controller(self) -> str:
        return self.open_controller().start()

    def replica_cmd(self, r: Replica) -> list[str]:
        cmd = [sys.executable, "-m", "phalanx.cli"]
        cmd += self.replica_argv(r, self.open_controller().target)
        ranks = self.ranks(r)
        if ranks > 1:
            # The replica's ranks, started together and failed together (its
            # launcher's exit is the replica's); forked from the zygote, the
            # launcher forks the ranks too (start_replica).
            return [sys.executable, "-m", RANKS, "--nproc", str(ranks), "--", *cmd]
        return cmd

    def ranks(self, r: Replica) -> int:
        """Processes of replica ``r``: ``[replica] ranks`` for the policy, else 1."""
        return self.cfg.replica.ranks if r.role == "policy" else 1

    def replica_argv(self, r: Replica, controller: str) -> list[str]:
        """``phalanx`` CLI arguments of replica ``r`` (one rank's)."""
        cmd = ["replica", "--role", r.role, "--name", r.name, "--controller", controller]
        if r.role == "policy":
            out = self.run_dir / "final" / f"{r.name}.safetensors"
            out.parent.mkdir(parents=True, exist_ok=True)
            cmd += ["--out", str(out)]
            if self.rl and self.cfg.diloco is None:
                # One checkpoint root for every policy replica: the leader saves, and
                # any replica (re)started later resumes from the newest save.
                cmd += ["--state", str(self.run_dir / "policy-state")]
        return cmd + self._cfg_args()

    def start_replica(self, r: Replica) -> None:
        cmd, log = self.replica_cmd(r), self.run_dir / f"{r.name}.log"
        gid = partition.gid_of(self.gids, r.name) if self.gids is not None else None
        forked = None
        if self.zygote is not None and cmd[:3] == [sys.executable, "-m", "phalanx.cli"]:
            forked = self.zygote.spawn(cmd[3:], log, True, gid=gid)
        elif self.zygote is not None and cmd[:3] == [sys.executable, "-m", RANKS]:
            forked = self.zygote.spawn(["--fork", *cmd[3:]], log, True, module=RANKS, gid=gid)
        r.proc = forked or spawn(cmd, log, subprocess.PIPE, gid=gid)
        r.started()
        threading.Thread(target=self._read, args=(r, r.proc), daemon=True).start()

    def _read(self, r: Replica, proc: Proc) -> None:
        """Copy ``proc``'s output to the replica's log, to its end, and take its lines in
        while it is the replica's current process. A process killed (chaos, a scale-down)
        may leave lines in the pipe that it wrote before it died: they go to the log too
        (a step it committed is in the log), though the replica, restarted, no longer
        heeds them."""
        assert proc.stdout is not None
        with (self.run_dir / f"{r.name}.log").open("ab") as log:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                with self.lock:
                    if r.proc is proc:
                        self._take(r, line)

    def _take(self, r: Replica, line: bytes | str) -> None:
        """One output line of replica ``r``'s current process (lock held)."""
        try:
            ev = json.loads(line)
        except ValueError:
            return
        if isinstance(ev, dict):
            self._on_event(r, ev)

    def _on_event(self, r: Replica, ev: dict[str, Any]) -> None:
        note = r.apply(ev, quiet_sync_failures=self.finished_at is not None)
        if note and (self.rl or ev.get("event") != "retry"):
            self.note(note)
        if ev.get("event") == "step" and r.step > len(self.commit_times):
            self.commit_times.append(time.monotonic())
        if self.tracking is not None:
            self.tracking.line(ev)

    def note(self, text: str) -> None:
        self.events.append(f"{time.monotonic() - self.started:7.1f}s  {text}")

    # -- main loop -------------------------------------------------------

    def status(self) -> Status | None:
        return self.poller.latest if self.poller is not None else None

    def finished(self) -> bool:
        """The job is over: the controller says so (RL), or a replica trained all steps (FT)."""
        if self.rl:
            st = self.status()
            return st is not None and st.rl is not None and st.rl.finished
        return any(r.done for r in self.replicas.values())

    def run(self, live: bool = True, as_json: bool = False) -> int:
        """Run the job to its end and print the summary. Returns the exit code: 0 when
        the job finished, 1 when it failed, 130 when interrupted (SIGINT/SIGTERM);
        in every case the children are stopped first."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Every replica started from here (forked by the zygote or not) caches its
        # tokenized training data in the run directory: a restart tokenizes nothing.
        os.environ[env.RUN_DIR] = str(self.run_dir.resolve())
        try:
            self.tracking = JobTracking.start(self.cfg, self.run_dir)
        except ValueError as e:
            print(f"phalanx run: {e}", file=sys.stderr, flush=True)
            return 1
        self.started, self.started_wall = time.monotonic(), time.time()
        old_term = signal.signal(signal.SIGTERM, _interrupt)
        view = View(self, live)
        code = 0
        try:
            self._start()
            if self.chaos is not None:
                self.chaos_runner = ChaosRunner(self.chaos, self)
                self.chaos_runner.start()
            with view:
                self._loop(view)
        except KeyboardInterrupt:
            self.error, code = "interrupted", 130
        except ControllerDown as e:  # the controller did not come up
            self.error = str(e)
        finally:
            if self.chaos_runner is not None:
                self.chaos_runner.close()  # first: a stopped replica takes no SIGTERM
            with self.lock:
                procs = [r.proc for r in self.replicas.values()]
            stop_all(procs)
            if self.zygote is not None:
                self.zygote.close()
            if self.poller is not None:
                self.poller.stop(final=self.controller is not None)
            if self.tracking is not None:
                with self.lock:  # the lines read meanwhile go in first
                    self.tracking.status(self.status())
                    self.tracking.close()
            if self.controller is not None:
                self.controller.stop()
            signal.signal(signal.SIGTERM, old_term)
        view.summary(as_json)
        return code or (1 if self.error else 0)

    def _start(self) -> None:
        self.open_controller()  # before the zygote: it may set the job token for both
        if self.use_zygote:
            # Its imports run while the controller comes up.
            roles = {r.role for r in self.replicas.values()}
            self.zygote = Zygote(preload_for(self.cfg, roles), self.run_dir / "zygote.log")
        url = self.start_controller()
        self.note(f"controller at {url}")
        # The token goes in the fragment, which browsers never send to the server (nor
        # put in a Referer); the page moves it to the tab's sessionStorage at once.
        token = quote(find_token(self.run_dir / "controller"), safe="")
        # One controller's page (the first of several: a standby's sends the browser on
        # to the leader's, and the page follows the leader from then on).
        self.dashboard = f"{url.split(',')[0]}/#token={token}"
        self.note(f"dashboard: {self.dashboard}")
        loop = self.cfg.rl.loop if self.cfg.rl is not None else None
        self.poller = StatusPoller(
            self.run_dir / "controller",
            loop.target_exact_match if loop else None,
            loop.window if loop else 1,
            target_reward=loop.target_reward if loop else None,
        )
        self.poller.start()
        with self.lock:
            for r in self.replicas.values():
                self.start_replica(r)

    def _loop(self, view: View) -> None:
        while not self._tick():
            if self.chaos_runner is not None:
                self.chaos_runner.tick()
            view.update()
            time.sleep(0.1)
        view.update()

    def _tick(self) -> bool:
        """One round of supervision. True when the job is over."""
        now = time.monotonic()
        if self.controller is not None:
            try:
                news = self.controller.check()
            except ControllerDown as e:
                self.error = str(e)
                self.note(f"{self.error}; stopping")
                return True
            if news is not None:
                self.note(news)
                url = (self.controller.url or "").split(",")[0]
                if url and self.dashboard and not self.dashboard.startswith(f"{url}/"):
                    # Its port was taken meanwhile: the dashboard moved with it.
                    self.dashboard = f"{url}/#{self.dashboard.split('#', 1)[1]}"
                    self.note(f"dashboard: {self.dashboard}")
        finished = self.finished()
        with self.lock:
            if self.tracking is not None:
                self.tracking.status(self.status())
            if finished and self.finished_at is None:
                self.finished_at = now
                self.note("job finished; waiting for replicas to exit")
            for r in list(self.replicas.values()):
                self._supervise(r, now, finished)
            if self.error:
                return True
            reps = list(self.replicas.values())
            if reps and all(r.done and not r.running for r in reps):
                return True  # every replica finished its part (the status may lag)
            if not finished:
                self._follow_desired(now)
                return False
            alive = [r for r in self.replicas.values() if r.running]
            if not self.rl:
                # FT: the job is over once one replica trained all steps; a replica
                # with no commit since its start (a chaos restart still starting) has
                # nothing left to train. One training beside the others is finishing
                # the last step (its step line may not be read yet; the quorum's first
                # replica saves the final checkpoint, each writes its final state): it
                # gets finish_grace_s, as in RL.
                idle = [r for r in alive if not r.done and not r.progress]
                stop_all([r.proc for r in idle])
                alive = [r for r in alive if r not in idle]
            if (
                alive
                and self.finished_at is not None
                and now - self.finished_at > self.finish_grace_s
            ):
                self.note(
                    f"stopping {', '.join(r.name for r in alive)} (no exit after the job ended)"
                )
                return True
            return not alive

    def _supervise(self, r: Replica, now: float, finished: bool) -> None:
        if r.retiring_since is not None:
            if not r.running:
                self.retired.append(self.replicas.pop(r.name))
                self.note(f"{r.name} stopped (scale down)")
            elif now - r.retiring_since > self.stop_grace_s:
                signal_proc(r.proc, signal.SIGKILL)
            return
        if r.proc is None:
            if r.restart_at is not None and finished:
                r.restart_at = None  # killed or crashed as the job ended: nothing left to do
                self.note(f"{r.name} not restarted: the job finished")
            elif r.restart_at is not None and now >= r.restart_at:
                self.start_replica(r)
                self.note(f"{r.name} restarted")
            return
        code = r.proc.poll()
        if code is None or r.done:
            return
        if self.rl and code == 0:
            # RL replicas exit 0 only when the controller says the job is over, or when
            # an operator drained them: either way, not to be restarted.
            r.done = True
            return
        if finished:
            r.proc = None
            return
        if code == EXIT_UNRECOVERABLE:  # it said why in one line; a restart cannot help
            # The first one says it and stops the job; others that found the same within
            # the same pass (a loaded machine) are not said again.
            if self.error is None:
                self.error = f"{r.name} cannot run: {last_line(self.run_dir / (r.name + '.log'))}"
                self.note(self.error)
            return
        r.failed_starts = 0 if r.progress else r.failed_starts + 1
        if r.failed_starts >= MAX_FAILED_STARTS:
            self.error = f"{r.name} exited {r.failed_starts} times in a row without progress"
            self.note(f"{self.error} (last code {code}); see {self.run_dir / (r.name + '.log')}")
            return
        self.note(f"{r.name} exited with {code}; restarting (see {r.name}.log)")
        r.proc, r.restart_at = None, now + RESTART_DELAY_S
        if self.tracking is not None:
            self.tracking.killed()

    def all_replicas(self) -> list[Replica]:
        return [*self.retired, *self.replicas.values()]


def _interrupt(signum: int, frame: object) -> None:
    # A SIGTERMed launcher must still stop its children (each leads its own
    # session, so a signal to the launcher's group does not reach them).
    raise KeyboardInterrupt

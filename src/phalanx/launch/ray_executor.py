"""Replicas as Ray actors: one actor per replica runs ``phalanx <argv>``
in its worker process, on whichever node Ray places it.

- **Logs.** For the length of the run, the actor points its file descriptors 1
  and 2 at a pipe that a thread reads into a line buffer, so it captures
  ``print``, logging, C extensions and child processes alike. The driver pulls
  new lines through an actor method (the actor has ``max_concurrency`` >= 2, so
  that this answers while the command runs): on :meth:`RayExecutor.stream_logs`,
  about once a second from :meth:`~RayExecutor.poll`, and once more when the
  replica ends or is cancelled. The driver keeps every line it pulled (and
  appends them to ``log_dir/<name>.log`` when given one). Lines a worker wrote
  after the last pull before it died are lost with it. Ray's own forwarding of
  worker output to the driver is turned off (``log_to_driver=False``) when this
  executor starts Ray, since the lines arrive here instead.
- **Ends.** The run's ObjectRef resolves to the command's exit code; a worker
  that died (killed, out of memory, node lost) makes it raise, and the replica
  is ``failed`` with Ray's reason. An actor that ended is killed at once, so that
  its CPUs go back to the pool.
- **Cancel** is ``ray.kill(actor)``: no SIGTERM, no grace. A replica that must
  save state on the way out is sent a signal first (:meth:`RayExecutor.signal`,
  with ``processes=True``).
- **Processes.** With ``processes=True`` each actor runs its replica as a child
  process (:meth:`ReplicaActor.spawn`): it can be signalled, a spec of N ranks
  runs under :mod:`phalanx.launch.ranks` in one actor that holds N times the
  per-replica resources (its ranks stay on one node), and the child advertises
  its node's IP. ``phalanx run --launcher ray`` uses this.
- **Network.** ``supports_inter_replica_network`` is ``processes``: Ray nodes
  reach each other at their node IPs, which the children advertise. Without it
  the replica runs in the worker, which may have no path to the others in
  serverless setups, and we do not rely on it: jobs that exchange only through
  object storage (decoupled DiLoCo) run there.

The command runs in a thread of the actor, not its main thread: a command that
installs signal handlers must skip that off the main thread (``phalanx agent``
and the controller do). ``spec.env`` is set in the worker's ``os.environ`` and
``spec.cwd`` with ``os.chdir`` before the command starts; both are the worker
process's own (one actor per process). With ``cwd=None`` the command runs in the
worker's default directory (on a local instance, the driver's).

``ray`` is an optional dependency (``pip install 'phalanx[ray]'``), imported
only when a :class:`RayExecutor` is made. phalanx must be importable on every
node that runs replicas (installed there, or shipped with ``runtime_env``'s
``py_modules``): the actor class is this module's, and it runs phalanx's CLI.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.launch.base import (
    ReplicaSpec,
    ReplicaState,
    ReplicaStatus,
    ServerlessExecutor,
    check_launch,
)
from phalanx.launch.ray_actor import ReplicaActor

__all__ = ["RayExecutor"]

log = logging.getLogger("phalanx.launch")

LOG_PULL_S = 1.0
"""How often :meth:`RayExecutor.poll` pulls new log lines of running replicas."""


def import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            f"RayExecutor must have the ray package: it is not importable ({e}). Install the "
            f"extra: pip install 'phalanx[ray]'."
        ) from e
    return ray


@dataclass
class _Run:
    """One launch of a replica name, as the driver sees it."""

    spec: ReplicaSpec
    attempt: int
    actor: Any
    run_ref: Any
    ready_ref: Any
    state: ReplicaState = ReplicaState.PENDING
    started_at: float | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    error: str | None = None
    pid: int | None = None
    node: dict[str, Any] | None = None
    """The actor's ``ready()``: pid, node IP and node id, once it started."""
    cursor: int = 0
    """Lines of this launch pulled so far (the actor's numbering)."""
    log_ref: Any = None
    """The pull in flight, if any; one at a time keeps the lines in order."""
    pulled_at: float = 0.0
    killed: bool = False

    def status(self) -> ReplicaStatus:
        return ReplicaStatus(
            self.spec.name,
            self.state,
            self.exit_code,
            self.started_at,
            self.ended_at,
            self.error,
            self.attempt,
        )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:500]


LOCAL_START_TRIES = 3
"""A local Ray instance that did not come up is started again this many times: Ray
waits a fixed 30 s for its raylet to register, which a busy host (every core
taken) can exceed."""


def init_ray(ray: Any, address: str | None, kwargs: dict[str, Any]) -> None:
    for attempt in range(1, LOCAL_START_TRIES + 1):
        try:
            ray.init(address=address, **kwargs)
            return
        except Exception as e:
            if address is not None or "timed out during startup" not in str(e):
                raise
            ray.shutdown()  # (stops what this attempt started)
            if attempt == LOCAL_START_TRIES:
                raise RuntimeError(
                    f"a local Ray instance did not start in {LOCAL_START_TRIES} tries (its "
                    f"raylet must register within Ray's 30 s): {e}. The host is overloaded: "
                    "free some CPU, or start Ray yourself (`ray start --head`) and pass its "
                    "address."
                ) from e
            log.warning("ray executor: the local Ray instance did not start (%s); again", e)


class RayExecutor(ServerlessExecutor):
    """Replicas as Ray actors; see the module doc.

    Connects to ``address`` (``"auto"``, ``"ray://host:10001"``, ...) or, when it
    is None, starts a local Ray instance; ``init_kwargs`` go to ``ray.init``
    (``num_cpus`` for a local instance, ``namespace``, ...), with
    ``include_dashboard=False`` and ``log_to_driver=False`` unless given. If this
    process is connected to Ray already, that connection is used as it is, and
    :meth:`close` leaves it open; otherwise :meth:`close` disconnects (and so
    stops the local instance it started). Each replica's actor asks for
    ``num_cpus_per_replica`` CPUs and ``num_gpus_per_replica`` GPUs (times the
    spec's ``ranks``), is placed by ``scheduling_strategy`` (``"SPREAD"``: across
    nodes, so that a lost node takes as few replicas as it can) and gets
    ``runtime_env``; a replica stays ``pending`` while the cluster cannot place
    it. ``processes`` runs each replica as the actor's child process (module doc).
    ``log_dir``, if given, gets a copy of each replica's pulled lines in
    ``<name>.log``; ``log_pull_s`` is how often :meth:`poll` pulls them.
    ``kill_wait_s`` bounds how long :meth:`cancel` waits to see a killed actor
    gone."""

    backend_name = "ray"

    def __init__(
        self,
        address: str | None = None,
        num_cpus_per_replica: float = 1,
        runtime_env: dict[str, Any] | None = None,
        *,
        log_dir: Path | str | None = None,
        kill_wait_s: float = 10.0,
        processes: bool = False,
        num_gpus_per_replica: float = 0,
        scheduling_strategy: str | None = None,
        log_pull_s: float = LOG_PULL_S,
        **init_kwargs: Any,
    ):
        self._ray = ray = import_ray()
        if num_cpus_per_replica < 0:
            raise ValueError(f"num_cpus_per_replica must be >= 0: got {num_cpus_per_replica}.")
        self.owns_connection = not ray.is_initialized()
        if self.owns_connection:
            init_kwargs.setdefault("include_dashboard", False)
            init_kwargs.setdefault("log_to_driver", False)
            init_ray(ray, address, init_kwargs)
        elif address is not None or init_kwargs:
            log.warning(
                "ray executor: this process is connected to Ray already; using that "
                "connection, and ignoring address=%r and %s",
                address,
                sorted(init_kwargs),
            )
        self.log_dir = Path(log_dir).absolute() if log_dir is not None else None
        if self.log_dir is not None:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        self.kill_wait_s = kill_wait_s
        self.processes = self.supports_inter_replica_network = processes
        self.log_pull_s = log_pull_s
        self.cpus, self.gpus = num_cpus_per_replica, num_gpus_per_replica
        self._options: dict[str, Any] = {
            "max_concurrency": 5,  # run + log pulls + ready + signal, concurrently
            "max_restarts": 0,  # a restart is the launcher's call (relaunch)
        }
        if runtime_env is not None:
            self._options["runtime_env"] = runtime_env
        if scheduling_strategy is not None:
            self._options["scheduling_strategy"] = scheduling_strategy
        self._actor_cls = ray.remote(ReplicaActor)
        self._lock = threading.Lock()
        self._runs: dict[str, _Run] = {}
        self._lines: dict[str, list[str]] = {}
        self._closed = False

    # -- launching ------------------------------------------------------

    def launch_replicas(self, specs: Iterable[ReplicaSpec]) -> list[str]:
        specs = list(specs)
        with self._lock:
            if self._closed:
                raise RuntimeError("ray executor must be open to launch replicas: it is closed.")
            self._refresh()
            check_launch(specs, [n for n, r in self._runs.items() if not r.state.ended])
            for s in specs:
                old = self._runs.get(s.name)
                attempt = 0 if old is None else old.attempt + 1
                if attempt:
                    self._add_lines(s.name, [f"--- relaunch {attempt} of {s.name} ---"])
                else:
                    self._lines[s.name] = []
                actor = self._actor_cls.options(
                    **self._options,
                    num_cpus=self.cpus * s.ranks,
                    num_gpus=self.gpus * s.ranks,
                ).remote()
                ready_ref = actor.ready.remote()
                if self.processes:
                    run_ref = actor.spawn.remote(s.argv, s.env, s.cwd, s.ranks)
                else:
                    run_ref = actor.run.remote(s.argv, s.env, s.cwd)
                self._runs[s.name] = _Run(s, attempt, actor, run_ref, ready_ref)
        return [s.name for s in specs]

    # -- logs -----------------------------------------------------------

    def _add_lines(self, name: str, lines: list[str]) -> None:
        self._lines.setdefault(name, []).extend(lines)
        if self.log_dir is not None and lines:
            with (self.log_dir / f"{name}.log").open("a", encoding="utf-8") as f:
                f.writelines(ln + "\n" for ln in lines)

    def _pull(self, run: _Run, wait_s: float) -> bool:
        """Take what a log pull brought, starting one if none is in flight and
        waiting up to ``wait_s`` for it. True when the run ended and every line
        of it is here. A dead actor brings nothing (its last lines are lost)."""
        if run.killed:
            return False
        if run.log_ref is None:
            run.log_ref = run.actor.logs.remote(run.cursor)
            run.pulled_at = time.monotonic()
        ready, _ = self._ray.wait([run.log_ref], timeout=wait_s, fetch_local=False)
        if not ready:
            return False
        ref, run.log_ref = run.log_ref, None
        try:
            lines, run.cursor, complete = self._ray.get(ref)
        except self._ray.exceptions.RayError:
            run.killed = True  # the actor is gone: ask it nothing more
            return False
        self._add_lines(run.spec.name, lines)
        return bool(complete)

    def _drain(self, run: _Run, timeout_s: float) -> None:
        """Pull until every line of an ended run is here, or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while not self._pull(run, max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline or run.killed:
                return

    def stream_logs(self, name: str, since: int = 0) -> tuple[list[str], int]:
        if since < 0:
            raise ValueError(f"log cursor must be >= 0: got {since}.")
        with self._lock:
            if name not in self._lines:
                raise KeyError(f"replica {name!r} was never launched on this executor")
            self._refresh()
            run = self._runs[name]
            if run.state is ReplicaState.RUNNING:
                self._pull(run, wait_s=5.0)
            lines = self._lines[name]
            return lines[since:], len(lines)

    def buffered_logs(self, name: str, since: int = 0) -> tuple[list[str], int]:
        """As :meth:`stream_logs`, but only the lines already pulled (by :meth:`poll`,
        every ``log_pull_s``): no remote call, so it never waits."""
        with self._lock:
            lines = self._lines[name]
            return lines[since:], len(lines)

    # -- watching -------------------------------------------------------

    def _kill(self, run: _Run) -> None:
        if not run.killed:
            run.killed = True
            self._ray.kill(run.actor, no_restart=True)

    def _refresh(self) -> None:
        """Record starts and ends; pull logs of running replicas now and then (lock held)."""
        ray = self._ray
        live = [r for r in self._runs.values() if not r.state.ended]
        if not live:
            return
        # fetch_local=False: "finished" is all we ask. Fetching a result from another
        # node within a zero timeout is cancelled each time, and never completes (a
        # replica on a worker node stayed pending for its whole run).
        refs = [r.run_ref for r in live]
        done, _ = ray.wait(refs, num_returns=len(live), timeout=0, fetch_local=False)
        done_ids = {ref.hex() for ref in done}
        pending = [r.ready_ref for r in live if r.state is ReplicaState.PENDING]
        started_ids: set[str] = set()
        if pending:
            started, _ = ray.wait(pending, num_returns=len(pending), timeout=0, fetch_local=False)
            started_ids = {ref.hex() for ref in started}
        now = time.monotonic()
        for run in live:
            if run.ready_ref.hex() in started_ids:
                try:
                    run.node = ray.get(run.ready_ref)
                    run.started_at, run.pid = run.node["started_at"], run.node["pid"]
                    run.state = ReplicaState.RUNNING
                except ray.exceptions.RayError:
                    pass  # never started: the run's ref says why
            if run.run_ref.hex() in done_ids:
                self._ended(run)
            elif run.state is ReplicaState.RUNNING and (
                run.log_ref is not None or now - run.pulled_at >= self.log_pull_s
            ):
                self._pull(run, wait_s=0.0)

    def _ended(self, run: _Run) -> None:
        ray = self._ray
        run.ended_at = time.time()
        try:
            run.exit_code = int(ray.get(run.run_ref))
        except ray.exceptions.RayError as e:
            run.state = ReplicaState.FAILED
            run.error = f"the replica's Ray actor died or never started: {_first_line(e)}"
            run.killed = True
            return
        if run.started_at is None:
            run.started_at = run.ended_at  # ended before a poll saw it start
        run.state = ReplicaState.SUCCEEDED if run.exit_code == 0 else ReplicaState.FAILED
        if run.exit_code != 0:
            run.error = f"exited with code {run.exit_code}"
        self._drain(run, timeout_s=10.0)
        self._kill(run)  # it has nothing left to do; give its CPUs back

    def poll(self) -> dict[str, ReplicaStatus]:
        with self._lock:
            self._refresh()
            return {n: r.status() for n, r in self._runs.items()}

    def pid(self, name: str) -> int | None:
        """The pid of the latest launch's worker process, on the node Ray placed it
        on; None until a poll saw it start."""
        with self._lock:
            self._refresh()
            return self._runs[name].pid

    def node(self, name: str) -> dict[str, Any] | None:
        """Where the latest launch of ``name`` runs: its ``pid``, ``node_ip`` and
        ``node_id``; None until a poll saw it start."""
        with self._lock:
            return self._runs[name].node

    def spec(self, name: str) -> ReplicaSpec:
        with self._lock:
            return self._runs[name].spec

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to the latest launch's process group (``processes=True``;
        one still pending gets it as it starts), and do not wait. SIGKILL kills the
        actor itself (its child dies with it): it works on an actor that does not
        answer, and its run ends ``failed``. A replica that ended is not signalled."""
        if not self.processes:
            raise ValueError("ray executor must run replicas as processes to signal them.")
        with self._lock:
            run = self._runs[name]
            if run.state.ended or run.killed:
                return
            if sig == signal.SIGKILL:
                self._kill(run)
            else:
                run.actor.signal.remote(int(sig))

    # -- stopping -------------------------------------------------------

    def cancel(self, name: str | None = None) -> None:
        with self._lock:
            if name is not None and name not in self._runs:
                raise KeyError(f"replica {name!r} was never launched on this executor")
            self._refresh()
            runs = list(self._runs.values()) if name is None else [self._runs[name]]
            targets = [r for r in runs if not r.state.ended]
            for r in targets:
                if r.state is ReplicaState.RUNNING:
                    self._pull(r, wait_s=1.0)  # the lines since the last pull
                self._kill(r)
                r.state, r.error, r.ended_at = ReplicaState.CANCELLED, "cancelled", time.time()
            refs = [r.run_ref for r in targets]
        if refs:
            # The run refs resolve (with an error) once the actors are gone.
            self._ray.wait(refs, num_returns=len(refs), timeout=self.kill_wait_s)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.cancel()
        with self._lock:
            for run in self._runs.values():
                self._kill(run)
        if self.owns_connection:
            self._ray.shutdown()

"""``phalanx run --launcher ray``: a job's replicas as Ray actors, any job kind.

The controller is what it is under the local launcher: a child process of
``phalanx run`` with its state dir on this machine's disk, restarted on the
same state dir and port when it dies. It binds the address the Ray nodes reach
this host at (the driver's Ray node IP, or ``--advertise-host``), and each
replica is told its URL and the job token.

Each replica (policy or rollout, one rank or N) is one actor of
:class:`~phalanx.launch.ray_executor.RayExecutor` with ``processes=True``: the
actor holds the replica's resources (N ranks: N times ``cpus_per_rank`` and
``gpus_per_rank``, on one node) and runs it as its child process, which
advertises the node's IP to its peers. Actors are spread across nodes, so a
lost node takes as few replicas as it can.

Supervision is :class:`~phalanx.launch.local.LocalJob`'s, unchanged: a replica
is a :class:`RayProc` (the part of ``Popen`` it uses), whose exit is its
actor's run ref. A node that Ray loses makes that ref raise: the replica has
failed, and is restarted by the same rules as a crashed local process (the
controller evicted it already: its lifeline dropped with the process).
``phalanx scale`` adds and removes actors the same way.

Paths are passed as they are on this host (the config, the run dir's final
states and the RL policy's checkpoint root): across hosts they must be on a
filesystem every node mounts at the same path, or be storage URLs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from phalanx import env
from phalanx.client import find_token
from phalanx.launch.base import ReplicaSpec, ReplicaState
from phalanx.launch.local import LocalJob
from phalanx.launch.replica import Replica

FOLLOW_S = 0.1
"""How often the launcher reads its actors' states and new lines."""
LOG_PULL_S = 0.2
"""How often new lines are pulled from each running actor."""
ACTOR_LOST = -1
"""The exit code of a replica whose actor died with no code (its node was lost,
Ray killed it): a failure, restarted like any other."""


@dataclass
class RayOptions:
    """``phalanx run --launcher ray``'s options."""

    address: str | None = None
    """The cluster (``HOST:PORT`` of its GCS, ``auto``, ``ray://``); None starts a
    local instance sized for the replicas."""
    cpus_per_rank: float = 1.0
    gpus_per_rank: float = 0.0


def shortage(
    needs: dict[str, tuple[int, int]],
    have: dict[str, float],
    cpus_per_rank: float,
    gpus_per_rank: float,
) -> str | None:
    """Why a cluster with resources ``have`` (``ray.cluster_resources()``) cannot run
    the roles' first replicas at once, in one line, or None.

    ``needs`` maps a role to ``(replicas, ranks per replica)``: its
    ``n_init_replicas``, which the role's first quorum waits for."""
    what = ", ".join(
        f"{n} {role} replica{'s' * (n != 1)}" + (f" of {k} ranks" if k > 1 else "")
        for role, (n, k) in needs.items()
        if n
    )
    ranks = sum(n * k for n, k in needs.values())
    for resource, per_rank in (("CPU", cpus_per_rank), ("GPU", gpus_per_rank)):
        want, got = ranks * per_rank, have.get(resource, 0.0)
        if want > got:
            return (
                f"the Ray cluster must have {want:g} {resource} for {what} (at {per_rank:g} "
                f"{resource} per rank): it has {got:g}. Add nodes (ray start --address ...), "
                f"or start fewer replicas (--replicas, roles.ROLE.n_init_replicas)."
            )
    return None


@dataclass
class RayProc:
    """One launch of a replica on the executor, seen as a process by
    :class:`LocalJob`: ``poll``, ``wait``, and ``deliver`` for signals (see
    :func:`phalanx.launch.procs.signal_proc`). Its end is set by the launcher's
    follower thread once every line pulled before it was taken in."""

    job: RayJob
    name: str
    attempt: int
    cursor: int
    """Lines of the executor's log of ``name`` already taken."""
    pid: int = 0
    """The actor's worker pid, on its node (0 until it started)."""
    returncode: int | None = None
    stdout: IO[bytes] | None = None
    placed: bool = False
    pending: list[str] = field(default_factory=list)
    ended: threading.Event = field(default_factory=threading.Event)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self.ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.name, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def deliver(self, sig: int) -> None:
        self.job.executor.signal(self.name, sig)


class RayJob(LocalJob):
    """:class:`LocalJob` with its replicas on a Ray cluster; see the module doc.
    Who calls: ``phalanx run`` (one per job)."""

    def __init__(self, *args: Any, ray: RayOptions, **kwargs: Any):
        kwargs["zygote"] = False  # replicas start on the nodes, not from a local fork
        super().__init__(*args, **kwargs)
        self.gids = None  # replicas on the nodes, which no nftables rule here cuts off
        self.run_dir = self.run_dir.absolute()
        self.ray = ray
        self.executor: Any = None
        """The :class:`~phalanx.launch.ray_executor.RayExecutor` (from :meth:`run` on)."""
        self.procs: list[RayProc] = []
        self._notes: list[str] = []
        """Lines for the operator, waiting for the job's lock."""
        self._stop = threading.Event()

    def _cfg_args(self) -> list[str]:
        config = str(Path(self.config_path).absolute()) if self.config_path else None
        return (["--config", config] if config else []) + self.overrides

    def needs(self) -> dict[str, tuple[int, int]]:
        """``(n_init_replicas, ranks)`` of each role."""
        return {
            role: (rc.n_init_replicas, self.ranks(Replica(f"{role}-0", role)))
            for role, rc in self.cfg.roles.items()
        }

    def run(self, live: bool = True, as_json: bool = False) -> int:
        from phalanx.launch.ray_executor import RayExecutor

        local: dict[str, Any] = {}
        if self.ray.address is None:  # a local instance, with room for every replica
            local["num_cpus"] = max(1, round(sum(n * k for n, k in self.needs().values())))
        try:
            self.executor = RayExecutor(
                self.ray.address,
                self.ray.cpus_per_rank,
                log_dir=self.run_dir,
                processes=True,
                num_gpus_per_replica=self.ray.gpus_per_rank,
                scheduling_strategy="SPREAD",
                log_pull_s=LOG_PULL_S,
                **local,
            )
        except Exception as e:  # said in one line: the job cannot start
            where = self.ray.address or "a local instance"
            print(f"phalanx run: the Ray cluster ({where}) must be reachable: {e}", file=sys.stderr)
            return 1
        follower = threading.Thread(target=self._follow, daemon=True, name="ray-follower")
        try:
            import ray

            short = shortage(
                self.needs(),
                ray.cluster_resources(),
                self.ray.cpus_per_rank,
                self.ray.gpus_per_rank,
            )
            if short is not None:
                print(f"phalanx run: {short}", file=sys.stderr, flush=True)
                return 1
            if self.controller_host is None:
                # The address the Ray nodes reach this host at.
                self.controller_host = ray.util.get_node_ip_address()
            follower.start()
            return super().run(live, as_json)
        finally:
            self._stop.set()
            if follower.is_alive():
                follower.join(timeout=10)
            self.executor.close()

    # -- replicas ---------------------------------------------------------

    def start_replica(self, r: Replica) -> None:
        assert self.controller is not None and self.controller.url
        token = find_token(self.run_dir / "controller")
        extra = {env.TOKEN: token}
        if os.environ.get(env.CA_FILE):
            extra[env.CA_FILE] = os.environ[env.CA_FILE]
        spec = ReplicaSpec(
            r.name,
            self.replica_argv(r, self.controller.url),
            extra,
            str(Path.cwd()),
            ranks=self.ranks(r),
        )
        self.executor.launch_replicas([spec])
        attempt = self.executor.poll()[r.name].attempt
        _, cursor = self.executor.buffered_logs(r.name, 1 << 62)
        proc = RayProc(self, r.name, attempt, cursor)
        self.procs.append(proc)
        r.proc = proc
        r.started()

    def _follow(self) -> None:
        while not self._stop.wait(FOLLOW_S):
            self.follow_once()

    def follow_once(self) -> None:
        """Take the actors' new lines into the replicas, then their ends."""
        statuses = self.executor.poll()
        live = [p for p in self.procs if p.returncode is None]
        ends: list[tuple[RayProc, int]] = []
        for p in live:
            lines, p.cursor = self.executor.buffered_logs(p.name, p.cursor)
            p.pending += lines
            st = statuses.get(p.name)
            if st is None or st.attempt != p.attempt:
                continue
            if not p.placed and st.state is not ReplicaState.PENDING:
                p.placed = True
                node = self.executor.node(p.name) or {}
                p.pid = int(node.get("pid") or 0)
                if node:
                    self._notes.append(
                        f"{p.name} on Ray node {node.get('node_ip')} "
                        f"({str(node.get('node_id'))[:8]}), pid {p.pid}"
                    )
            if st.ended:
                code = 0 if st.state is ReplicaState.SUCCEEDED else st.exit_code
                if code is None:
                    code = ACTOR_LOST
                    if st.state is ReplicaState.FAILED:
                        self._notes.append(f"{p.name}: {st.error}")
                ends.append((p, code))
        # LocalJob may hold its lock while it waits for a process to end (stop_all,
        # chaos): then the end goes first, and the lines and notes wait (notes are
        # taken under the lock only: the view prints them from there).
        if self.lock.acquire(timeout=0.2):
            try:
                for p in live:
                    r = self.replicas.get(p.name)
                    if r is not None and r.proc is p:
                        for line in p.pending:
                            self._take(r, line)
                    p.pending.clear()
                for note in self._notes:
                    self.note(note)
                self._notes.clear()
            finally:
                self.lock.release()
        for p, code in ends:
            p.returncode = code
            p.ended.set()

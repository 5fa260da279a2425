"""``phalanx run`` for a decoupled DiLoCo job (``diloco.mode = "objectstore"``):
start the slots ``r0 .. r<n-1>`` on an executor (``diloco.executor``: ``local``
processes or ``ray`` actors), follow their JSON lines, relaunch a slot that
failed (up to ``diloco.max_restarts`` times each: it catches up from
storage), and end with a summary once every slot is done.

The slots share nothing but ``diloco.url``; the launcher needs no network
path to them either, only the executor's logs.
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from phalanx.config import DiLoCoSection, JobConfig
from phalanx.jobs.base import EXIT_UNRECOVERABLE
from phalanx.launch.base import ReplicaSpec, ReplicaState, ServerlessExecutor
from phalanx.track.job import JobTracking

log = logging.getLogger("phalanx.launch")


def make_executor(dc: DiLoCoSection, run_dir: Path) -> ServerlessExecutor:
    """The executor ``diloco.executor`` names."""
    if dc.executor == "ray":
        from phalanx.launch.ray_executor import RayExecutor

        if dc.ray_address:
            return RayExecutor(dc.ray_address, dc.ray_cpus_per_replica, log_dir=run_dir / "logs")
        # A local instance gets a logical CPU per slot (Ray's CPUs are a
        # scheduling resource): every slot must run at once, or a round that
        # waits for min_replicas would wait for slots Ray keeps pending.
        return RayExecutor(
            None,
            dc.ray_cpus_per_replica,
            log_dir=run_dir / "logs",
            num_cpus=max(1, math.ceil(dc.replicas * dc.ray_cpus_per_replica)),
        )
    from phalanx.launch.local_executor import LocalProcessExecutor

    return LocalProcessExecutor(run_dir / "logs")


class DecoupledJob:
    """Who calls: ``phalanx run`` (one per job). Not thread-safe."""

    def __init__(
        self,
        config_path: str,
        cfg: JobConfig,
        run_dir: Path,
        overrides: list[str],
        poll_s: float = 0.2,
    ):
        if cfg.diloco is None or cfg.diloco.mode != "objectstore":
            raise ValueError(
                'a decoupled DiLoCo job needs diloco.mode = "objectstore": got '
                f"{cfg.diloco.mode if cfg.diloco else 'no [diloco] section'}."
            )
        self.cfg, self.dc = cfg, cfg.diloco
        self.config_path = str(Path(config_path).absolute())
        self.run_dir, self.overrides, self.poll_s = run_dir, overrides, poll_s
        self.slots = self.dc.slot_names
        self.names = [*self.slots, *(["syncer"] if self.dc.aggregator == "syncer" else [])]
        self.cursor = dict.fromkeys(self.names, 0)
        self.last: dict[str, dict[str, Any]] = {}
        self.said: dict[str, str] = {}
        """Each slot's last line that is not an event (its one-line error, when it fails)."""
        self.restarts = dict.fromkeys(self.names, 0)
        self.printed_round = 0
        self.members: dict[int, list[str]] = {}
        self.losses: dict[int, list[float]] = {}
        self.error: str | None = None
        self.tracking: JobTracking | None = None
        """The job's metrics, one value per round (``[track]``)."""

    def spec(self, name: str) -> ReplicaSpec:
        if name == "syncer":
            argv = ["syncer", "--config", self.config_path, *self.overrides]
        else:
            argv = ["replica", "--config", self.config_path, "--name", name]
            out = (self.run_dir / f"{name}.safetensors").absolute()
            argv += ["--out", str(out), *self.overrides]
        threads = str(self.cfg.train.threads)
        return ReplicaSpec(name, argv, {"OMP_NUM_THREADS": threads}, str(Path.cwd()))

    def run(self, as_json: bool = False) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.tracking = JobTracking.start(self.cfg, self.run_dir)
        except ValueError as e:
            print(f"phalanx run: {e}", file=sys.stderr, flush=True)
            return 1
        t0 = time.monotonic()
        try:
            return self._run(t0, as_json)
        finally:
            self.tracking.close()

    def _run(self, t0: float, as_json: bool) -> int:
        with make_executor(self.dc, self.run_dir) as ex:
            print(
                f"phalanx run: decoupled DiLoCo job {self.cfg.job.id}: {self.dc.replicas} slots "
                f"on the {ex.backend_name} executor, exchanging through {self.dc.url} every "
                f"{self.dc.sync_every} inner steps; logs in {self.run_dir / 'logs'}",
                flush=True,
            )
            self._note_existing_state()
            ex.launch_replicas([self.spec(n) for n in self.names])
            try:
                while not self._step(ex, t0):
                    time.sleep(self.poll_s)
            except KeyboardInterrupt:
                self.error = "interrupted"
                ex.cancel()
            self._drain(ex)
        summary = self.summary(time.monotonic() - t0)
        print(summary_line(summary), flush=True)
        if as_json:
            print(json.dumps(summary), flush=True)
        return 0 if self.error is None else (130 if self.error == "interrupted" else 1)

    def _note_existing_state(self) -> None:
        import fsspec

        fs, root = fsspec.core.url_to_fs(self.dc.url, **self.dc.storage_options)
        found = fs.glob(f"{root.rstrip('/')}/replicas/r*.st")
        if found:
            print(
                f"phalanx run: {len(found)} slot state(s) already under {self.dc.url}: the "
                f"slots resume from them (delete {self.dc.url} to start over)",
                flush=True,
            )

    def _drain(self, ex: ServerlessExecutor) -> None:
        for name in self.names:
            lines, self.cursor[name] = ex.stream_logs(name, self.cursor[name])
            for line in lines:
                self._take(name, line)

    def _step(self, ex: ServerlessExecutor, t0: float) -> bool:
        """Read new lines, relaunch failed slots. True once the job is over."""
        self._drain(ex)
        states = ex.poll()
        for name, st in states.items():
            if st.state != ReplicaState.FAILED:
                continue
            if st.exit_code == EXIT_UNRECOVERABLE:  # said why; a restart cannot help
                self.error = f"{name} cannot run: {self.said.get(name, st.error)}"
                ex.cancel()
                return True
            if self.restarts[name] >= self.dc.max_restarts:
                self.error = f"{name} failed {self.restarts[name] + 1} times; last: {st.error}"
                ex.cancel()
                return True
            self.restarts[name] += 1
            if self.tracking is not None:
                self.tracking.killed()
            print(
                f"{time.monotonic() - t0:7.1f}s  {name} failed ({st.error}); relaunching "
                f"(restart {self.restarts[name]}/{self.dc.max_restarts}); it catches up from "
                f"storage",
                flush=True,
            )
            ex.relaunch(name)
        self._progress(t0)
        return all(st.state == ReplicaState.SUCCEEDED for st in states.values())

    def _take(self, name: str, line: str) -> None:
        if not line.startswith("{"):
            if line.strip():
                self.said[name] = line.strip()
            return
        try:
            ev = json.loads(line)
        except json.JSONDecodeError:
            return
        if not isinstance(ev, dict) or "event" not in ev:
            return
        self.last[name] = ev if ev["event"] != "start" else {**self.last.get(name, {}), **ev}
        if self.tracking is not None:
            self.tracking.line(ev)
        if ev["event"] == "round":
            self.members[int(ev["round"])] = list(ev["members"])
            self.losses.setdefault(int(ev["round"]), []).append(float(ev["loss"]))

    def _progress(self, t0: float) -> None:
        rounds = self.cfg.job_steps
        lead = max(self.members, default=0)
        if lead >= self.printed_round + max(1, rounds // 20) or (
            lead == rounds and lead > self.printed_round
        ):
            self.printed_round = lead
            loss = self.losses.get(lead, [])
            mean = sum(loss) / len(loss) if loss else float("nan")
            print(
                f"{time.monotonic() - t0:7.1f}s  round {lead:4d}/{rounds}  inner loss "
                f"{mean:.5f}  members {','.join(self.members[lead])}",
                flush=True,
            )

    def summary(self, wall_s: float) -> dict[str, Any]:
        done = {n: e for n, e in self.last.items() if e.get("event") == "done" and n in self.slots}
        full = [n for n, m in sorted(self.members.items()) if len(m) == self.dc.replicas]
        return {
            "event": "summary",
            "job": self.cfg.job.id,
            "mode": "objectstore",
            "executor": self.dc.executor,
            "ok": self.error is None and len(done) == len(self.slots),
            "error": self.error,
            "rounds": max(self.members, default=0),
            "loss": (
                sum(self.losses[max(self.losses)]) / len(self.losses[max(self.losses)])
                if self.losses
                else None
            ),
            "rounds_with_every_slot": len(full),
            "inner_steps": self.cfg.train.steps,
            "restarts": sum(self.restarts.values()),
            "left_out": sum(int(e.get("left_out", 0)) for e in done.values()),
            "corrupt": sum(int(e.get("corrupt", 0)) for e in done.values()),
            "bytes_sent": sum(int(e.get("bytes_sent", 0)) for e in done.values()),
            "bytes_read": sum(int(e.get("bytes_read", 0)) for e in done.values()),
            "wall_s": round(wall_s, 2),
            "run_dir": str(self.run_dir),
        }


def summary_line(s: dict[str, Any]) -> str:
    return (
        f"job {s['job']}: {s['rounds']} outer rounds ({s['inner_steps']} inner steps) in "
        f"{s['wall_s']:.1f} s on the {s['executor']} executor; {s['rounds_with_every_slot']} "
        f"rounds with every slot; {s['restarts']} restart(s), {s['left_out']} left-out "
        f"contribution(s), {s['corrupt']} corrupt object(s); {s['bytes_sent']} bytes written, "
        f"{s['bytes_read']} read. Logs and final states: {s['run_dir']}"
        + (f". FAILED: {s['error']}" if s["error"] else "")
    )

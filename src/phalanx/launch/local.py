"""``phalanx run``: a whole job on this machine. It starts the controller and the
replicas as local processes, shows live progress, and can deliver chaos
(SIGKILL a random replica on a period, restart it after a delay) so that
anyone can watch the job survive.

Every process is started in its own process group and stopped by its pid;
nothing is ever killed by name.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from phalanx.config import JobConfig


@dataclass
class Chaos:
    kill_every_s: float
    restart_after_s: float = 2.0
    seed: int = 0

    @staticmethod
    def parse(text: str) -> Chaos:
        """``kill-every=SECONDS[,restart-after=SECONDS][,seed=N]``."""
        opts: dict[str, str] = {}
        for part in filter(None, text.split(",")):
            k, sep, v = part.partition("=")
            if not sep:
                raise ValueError(f"--chaos entries must look like key=value: got {part!r}.")
            opts[k.strip()] = v.strip()
        unknown = set(opts) - {"kill-every", "restart-after", "seed"}
        if unknown or "kill-every" not in opts:
            raise ValueError(
                f"--chaos must be kill-every=SECONDS[,restart-after=SECONDS][,seed=N]: got {text!r}."
            )
        try:
            c = Chaos(
                float(opts["kill-every"]),
                float(opts.get("restart-after", 2.0)),
                int(opts.get("seed", 0)),
            )
        except ValueError:
            raise ValueError(f"--chaos values must be numbers: got {text!r}.") from None
        if c.kill_every_s <= 0 or c.restart_after_s < 0:
            raise ValueError(
                f"--chaos kill-every must be > 0 and restart-after >= 0: got {text!r}."
            )
        return c


@dataclass
class Replica:
    name: str
    proc: subprocess.Popen | None = None
    step: int = 0
    loss: float | None = None
    participants: int = 0
    quorum_id: int = 0
    replica_id: str = ""
    starts: int = 0
    kills: int = 0
    heals: int = 0
    done: bool = False
    restart_at: float | None = None
    last: dict[str, Any] = field(default_factory=dict)


def _spawn(cmd: list[str], log: Path, stdout: int | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        cmd,
        stdout=stdout if stdout is not None else log.open("ab"),
        stderr=log.open("ab"),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen | None, sig: int = signal.SIGTERM, wait_s: float = 5.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
        proc.wait(wait_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


class LocalJob:
    def __init__(
        self,
        config_path: str | None,
        cfg: JobConfig,
        run_dir: Path,
        overrides: list[str],
        replicas: int,
        chaos: Chaos | None = None,
    ):
        self.config_path = config_path
        self.cfg = cfg
        self.run_dir = run_dir
        self.overrides = overrides
        self.chaos = chaos
        self.replicas = {f"policy-{i}": Replica(f"policy-{i}") for i in range(replicas)}
        self.controller: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self.events: list[str] = []
        self.started = time.monotonic()
        self.commit_times: list[float] = []
        self._rng = random.Random(chaos.seed if chaos else 0)

    # -- processes -------------------------------------------------------

    def _base(self) -> list[str]:
        cmd = [sys.executable, "-m", "phalanx.cli"]
        return cmd

    def _cfg_args(self) -> list[str]:
        return (["--config", self.config_path] if self.config_path else []) + self.overrides

    def start_controller(self) -> str:
        state = self.run_dir / "controller"
        url_file = state / "url"
        url_file.unlink(missing_ok=True)
        cmd = [*self._base(), "controller", "--state-dir", str(state), *self._cfg_args()]
        self.controller = _spawn(cmd, self.run_dir / "controller.log")
        deadline = time.monotonic() + 30
        while not url_file.exists():
            if self.controller.poll() is not None:
                raise RuntimeError(
                    f"controller exited with {self.controller.returncode}; see {self.run_dir / 'controller.log'}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError("controller did not publish its URL within 30 s")
            time.sleep(0.05)
        return url_file.read_text().strip()

    def start_replica(self, r: Replica) -> None:
        out = self.run_dir / "final" / f"{r.name}.safetensors"
        out.parent.mkdir(parents=True, exist_ok=True)
        cmd = [
            *self._base(), "replica", "--role", "policy", "--name", r.name,
            "--controller", str(self.run_dir / "controller"), "--out", str(out), *self._cfg_args(),
        ]  # fmt: skip
        r.proc = _spawn(cmd, self.run_dir / f"{r.name}.log", stdout=subprocess.PIPE)
        r.starts += 1
        r.done = False
        r.restart_at = None
        r.step, r.loss, r.participants = 0, None, 0
        threading.Thread(target=self._read, args=(r, r.proc), daemon=True).start()

    def _read(self, r: Replica, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            with self.lock:
                if r.proc is not proc:
                    return
                r.last = ev
                r.replica_id = ev.get("replica", r.replica_id)
                if ev.get("event") == "step":
                    r.step, r.loss = ev["step"], ev["loss"]
                    r.participants, r.quorum_id = ev["participants"], ev["quorum_id"]
                    if ev.get("healed"):
                        r.heals += 1
                        self.note(f"{r.name} healed to step {ev['step']}")
                    if r.step > len(self.commit_times):
                        self.commit_times.append(time.monotonic())
                elif ev.get("event") == "done":
                    r.done = True

    def note(self, text: str) -> None:
        self.events.append(f"{time.monotonic() - self.started:7.1f}s  {text}")

    # -- main loop -------------------------------------------------------

    def run(self, live: bool = True) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        url = self.start_controller()
        self.note(f"controller at {url}")
        for r in self.replicas.values():
            self.start_replica(r)
        next_kill = time.monotonic() + self.chaos.kill_every_s if self.chaos else None
        view = _View(self, live)
        try:
            with view:
                while True:
                    now = time.monotonic()
                    with self.lock:
                        for r in self.replicas.values():
                            self._supervise(r, now)
                        finished = any(r.done for r in self.replicas.values())
                        if finished:
                            # The job is over: a replica still starting (chaos restart)
                            # has nothing left to train.
                            for r in self.replicas.values():
                                if not r.done:
                                    _stop(r.proc)
                        if finished and all(
                            r.proc is None or r.proc.poll() is not None
                            for r in self.replicas.values()
                        ):
                            break
                        if next_kill is not None and now >= next_kill and not finished:
                            self._kill_one()
                            next_kill = now + self.chaos.kill_every_s  # type: ignore[union-attr]
                    view.update()
                    time.sleep(0.1)
        finally:
            for r in self.replicas.values():
                _stop(r.proc)
            _stop(self.controller)
        view.summary()
        return 0

    def _supervise(self, r: Replica, now: float) -> None:
        finished = any(x.done for x in self.replicas.values())
        if r.proc is None:
            if r.restart_at is not None and now >= r.restart_at and not finished:
                self.start_replica(r)
                self.note(f"{r.name} restarted")
            return
        code = r.proc.poll()
        if code is None or r.done:
            return
        self.note(f"{r.name} exited with {code}; restarting (see {r.name}.log)")
        r.proc, r.restart_at = None, now + 1.0

    def _kill_one(self) -> None:
        # Kill only when every replica is up and has committed since its start,
        # so that at most one is down at a time and a healthy peer always
        # holds the job's state (until checkpoints can restore it).
        reps = list(self.replicas.values())
        alive = [r for r in reps if r.proc is not None and r.proc.poll() is None and r.step > 0]
        if len(alive) < len(reps) or len(alive) < 2:
            return
        r = self._rng.choice(alive)
        os.killpg(r.proc.pid, signal.SIGKILL)  # type: ignore[union-attr]
        r.proc.wait()  # type: ignore[union-attr]
        r.proc = None
        r.kills += 1
        r.restart_at = time.monotonic() + self.chaos.restart_after_s  # type: ignore[union-attr]
        self.note(f"chaos: SIGKILL {r.name} at step {r.step}")


class _View:
    """Live progress: a rich table on a terminal, plain lines otherwise."""

    def __init__(self, job: LocalJob, live: bool):
        self.job = job
        self.live_enabled = live and sys.stdout.isatty()
        self._live: Any = None
        self._printed_step = 0
        self._printed_events = 0

    def __enter__(self) -> _View:
        if self.live_enabled:
            from rich.live import Live

            self._live = Live(self._render(), refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.__exit__(*exc)

    def _render(self) -> Any:
        from rich.console import Group
        from rich.table import Table

        job = self.job
        steps = job.cfg.train.steps
        t = Table(
            title=f"phalanx run: job {job.cfg.job.id}  ({time.monotonic() - job.started:.0f} s)"
        )
        for col in ("replica", "pid", "step", "loss", "participants", "quorum", "starts", "heals"):
            t.add_column(col)
        with job.lock:
            for r in job.replicas.values():
                state = "done" if r.done else ("down" if r.proc is None else str(r.proc.pid))
                loss = f"{r.loss:.5f}" if r.loss is not None else "-"
                t.add_row(
                    r.name,
                    state,
                    f"{r.step}/{steps}",
                    loss,
                    str(r.participants),
                    str(r.quorum_id),
                    str(r.starts),
                    str(r.heals),
                )
            events = "\n".join(job.events[-6:])
        return Group(t, events)

    def update(self) -> None:
        if self._live is not None:
            self._live.update(self._render())
            return
        job = self.job
        with job.lock:
            for line in job.events[self._printed_events :]:
                print(line, flush=True)
            self._printed_events = len(job.events)
            lead = max(job.replicas.values(), key=lambda r: r.step)
            if lead.step >= self._printed_step + 25 or (
                lead.step == job.cfg.train.steps and lead.step > self._printed_step
            ):
                self._printed_step = lead.step
                print(
                    f"{time.monotonic() - job.started:7.1f}s  step {lead.step:5d}  loss {lead.loss:.5f}  "
                    f"participants {lead.participants}  quorum {lead.quorum_id}",
                    flush=True,
                )

    def summary(self) -> None:
        job = self.job
        wall = time.monotonic() - job.started
        lead = max(job.replicas.values(), key=lambda r: r.step)
        gaps = [b - a for a, b in zip(job.commit_times, job.commit_times[1:], strict=False)]
        kills = sum(r.kills for r in job.replicas.values())
        heals = sum(r.heals for r in job.replicas.values())
        print(
            f"\njob {job.cfg.job.id}: {lead.step} steps committed in {wall:.1f} s, final loss "
            f"{lead.loss:.5f}; {kills} replica(s) killed, {heals} heal(s); longest gap between "
            f"commits {max(gaps) if gaps else 0:.2f} s. Logs and final states: {job.run_dir}",
            flush=True,
        )

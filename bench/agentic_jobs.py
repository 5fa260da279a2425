"""The process half of ``bench/agentic.py``: one agentic RL job from real processes
(``phalanx controller``, one ``phalanx replica --role policy``, N ``phalanx replica
--role rollout``), optionally SIGKILLing rollout replicas mid-episode and starting
them again, and the JSON lines every process printed.

Driven here rather than through ``phalanx run --chaos`` so that only rollout
replicas are killed (``--chaos`` picks any replica, the policy too), each kill lands
mid-episode (see :meth:`Job._mid_episode`), and each incarnation of a replica writes
a log of its own (``rollout-0.1.log`` is ``rollout-0``'s second process): the turns a
killed process made are its log's ``turn`` lines, with nothing to untangle.

Every child runs in its own session and is stopped by its process group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from phalanx.client.transport import find_token
from phalanx.launch.procs import spawn, stop_all
from phalanx.launch.supervise import ControllerProcess

STOP_S = 60.0
"""After the job finished, how long its replicas get to exit on their own."""


def read_events(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a replica's log (its stdout and stderr share the file)."""
    out = []
    with contextlib.suppress(OSError):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    ev = json.loads(line)
                    if isinstance(ev, dict) and "event" in ev:
                        out.append(ev)
    return out


@dataclass
class Incarnation:
    """One process of a replica."""

    name: str
    k: int
    log: Path
    proc: Any
    killed_at: float | None = None
    """Wall time of its SIGKILL (None: it was not killed)."""

    @property
    def label(self) -> str:
        return f"{self.name}.{self.k}"

    def events(self) -> list[dict[str, Any]]:
        return read_events(self.log)


@dataclass
class Chaos:
    """SIGKILL a rollout replica mid-episode every ``every_s`` (counted from the
    previous kill's restart being up), ``kills`` times, alternating replicas; start it
    again ``restart_after_s`` later."""

    every_s: float
    kills: int
    restart_after_s: float = 1.0
    after_turns: tuple[int, ...] = (1,)
    """Kill ``k`` waits for ``after_turns[k % len]`` turn lines of the victim's current
    lease (e.g. one round of its episodes' turns, then two), so that kills land at
    different depths of the episodes."""


@dataclass
class Job:
    work: Path
    config: Path
    overrides: list[str]
    rollouts: int
    chaos: Chaos | None = None
    timeout_s: float = 600.0
    procs: list[Incarnation] = field(default_factory=list)
    status: dict[str, Any] = field(default_factory=dict)
    """The controller's last status (``/v1/status``)."""
    t0: float = 0.0
    error: str | None = None

    def _args(self) -> list[str]:
        return ["--config", str(self.config), *self.overrides]

    def _start(self, role: str, name: str) -> Incarnation:
        k = sum(p.name == name for p in self.procs)
        log = self.work / f"{name}.{k}.log"
        cmd = [sys.executable, "-m", "phalanx.cli", "replica", "--role", role, "--name", name]
        cmd += ["--controller", str(self.work / "controller")]
        if role == "policy":
            cmd += ["--state", str(self.work / "policy-state")]
        inc = Incarnation(name, k, log, spawn([*cmd, *self._args()], log))
        self.procs.append(inc)
        return inc

    def _status(self, url: str, token: str) -> dict[str, Any]:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            r = httpx.get(
                f"{url}/v1/status", headers={"Authorization": f"Bearer {token}"}, timeout=5.0
            )
            r.raise_for_status()
            self.status = r.json()
        return self.status

    def live(self, name: str) -> Incarnation:
        return next(p for p in reversed(self.procs) if p.name == name)

    def run(self) -> Job:
        """Run the job to its end (every replica exited after the controller said
        finished), or, with :attr:`chaos`, until the kills are done and every rollout
        a killed process left unsubmitted was submitted by someone. Sets
        :attr:`error` on a timeout or a replica that failed."""
        self.work.mkdir(parents=True, exist_ok=True)
        ctl = ControllerProcess(
            self.work / "controller", self._args(), self.work / "controller.log"
        )
        self.t0 = time.time()
        try:
            url = ctl.start()
            token = find_token(self.work / "controller")
            self._start("policy", "policy-0")
            names = [f"rollout-{i}" for i in range(self.rollouts)]
            for n in names:
                self._start("rollout", n)
            self._loop(ctl, url, token, names)
        finally:
            stop_all([p.proc for p in self.procs])
            ctl.stop()
        return self

    def _loop(self, ctl: ControllerProcess, url: str, token: str, names: list[str]) -> None:
        deadline = time.monotonic() + self.timeout_s
        kills, next_kill, finished_at = 0, time.monotonic(), None
        restart: tuple[float, str] | None = None
        if self.chaos is not None:
            next_kill += self.chaos.every_s
        while time.monotonic() < deadline:
            time.sleep(0.1)
            news = ctl.check()
            if news and "restart" in news:
                self.error = f"the controller failed: {news}"
                return
            for p in self.procs:
                code = p.proc.poll()
                if code not in (None, 0) and p.killed_at is None:
                    self.error = f"{p.label} exited with {code}; see {p.log}"
                    return
            if restart is not None and time.monotonic() >= restart[0]:
                self._start("rollout", restart[1])
                restart = None
            if self.chaos is not None:
                if kills >= self.chaos.kills:
                    if restart is None and self.unresolved() == 0:
                        self._status(url, token)
                        return
                    continue
                victim = names[kills % len(names)]
                if restart is None and time.monotonic() >= next_kill and self._ready(names):
                    inc = self.live(victim)
                    if self._mid_episode(
                        inc, self.chaos.after_turns[kills % len(self.chaos.after_turns)]
                    ):
                        inc.killed_at = time.time()
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(inc.proc.pid, signal.SIGKILL)
                        inc.proc.wait()
                        kills += 1
                        restart = (time.monotonic() + self.chaos.restart_after_s, victim)
                        next_kill = time.monotonic() + self.chaos.every_s
                continue
            st = self._status(url, token).get("rl") or {}
            if st.get("finished") and finished_at is None:
                finished_at = time.monotonic()
            if finished_at is not None and all(p.proc.poll() is not None for p in self.procs):
                return
            if finished_at is not None and time.monotonic() - finished_at > STOP_S:
                return  # the replicas' logs hold what the figures need; stop_all follows
        self._status(url, token)
        self.error = f"the job did not end within {self.timeout_s:.0f} s"

    def _ready(self, names: list[str]) -> bool:
        """Every rollout replica's current process generated something (a kill never
        finds another replica still starting)."""
        return all(
            any(e["event"] == "turn" for e in self.live(n).events())
            and self.live(n).proc.poll() is None
            for n in names
        )

    @staticmethod
    def _mid_episode(inc: Incarnation, turns: int) -> bool:
        """Its last line is a ``turn`` of the lease it holds (not submitted yet), and
        that lease has printed at least ``turns`` of them: the kill finds episodes
        between their first and last turn, with the next turns in flight (being
        generated, or generated and not yet reported: a turn's line follows its
        report), or the episodes' tools running."""
        evs = inc.events()
        since = 0
        for e in reversed(evs):
            if e["event"] != "turn":
                break
            since += 1
        return since >= turns and evs[-1]["event"] == "turn"

    def unresolved(self) -> int:
        """Rollouts a killed process made turns for, submitted by nobody yet."""
        submitted = {
            r
            for p in self.procs
            for e in p.events()
            if e["event"] == "rollout"
            for r in e["rollouts"]
        }
        left = {
            e["rollout"]
            for p in self.procs
            if p.killed_at is not None
            for e in p.events()
            if e["event"] == "turn"
        }
        return len(left - submitted)

    def rollout_procs(self) -> list[Incarnation]:
        return [p for p in self.procs if p.name.startswith("rollout-")]

    def policy_events(self) -> list[dict[str, Any]]:
        return [e for p in self.procs if p.name.startswith("policy-") for e in p.events()]

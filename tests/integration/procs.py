"""Real processes for the integration tests: a controller (``phalanx controller``)
and replicas (``replica_proc.py``), each in its own process group, cleaned up
by process group at teardown. Ports are always picked by the OS (port 0)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from itertools import pairwise
from pathlib import Path
from typing import Any, TypeVar

import httpx

from phalanx import env

T = TypeVar("T")

REPLICA_SCRIPT = Path(__file__).with_name("replica_proc.py")
PROGRESS_S = 240.0
"""Bound on waiting for processes to start (imports) and make their first progress. A
wait ends at the event; this only caps a hang. On a machine busy with other work the
start of several torch processes alone has taken over a minute."""

FAST_TIMEOUTS = {
    "heartbeat_interval_s": 0.2,
    "heartbeat_s": 2.0,
    "suspect_grace_s": 0.25,
    "collective_s": 1.0,
    "quorum_s": 30.0,
}


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.02) -> T:
    """Poll ``predicate`` until it returns something truthy; return that. Fails the
    test with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


def names(replica_ids: list[str]) -> set[str]:
    """Replica names of a list of replica ids (``name:incarnation``)."""
    return {rid.split(":", 1)[0] for rid in replica_ids}


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return json.dumps(str(v))


def write_job_toml(path: Path, sections: dict[str, dict[str, Any]]) -> Path:
    lines = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return path


def child_env() -> dict[str, str]:
    e = dict(os.environ)
    e.pop(env.TOKEN, None)  # the token comes from the state dir
    e.pop(env.CONTROLLER, None)
    e["PYTHONUNBUFFERED"] = "1"
    return e


def cli_status(controller: Path) -> dict[str, Any]:
    """``phalanx status --json`` of the controller at ``controller`` (its state dir), run
    as a user runs it."""
    p = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "status", "--json", "--controller", str(controller)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=120,  # a bound on a loaded machine, not a margin: it answers in moments
    )
    assert p.returncode == 0, p.stderr
    data: dict[str, Any] = json.loads(p.stdout)
    return data


class Procs:
    """Every process a test started; :meth:`cleanup` kills each one's process group."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.started: list[subprocess.Popen[bytes]] = []
        self._n = 0

    def spawn(
        self,
        args: list[str],
        label: str,
        env: dict[str, str] | None = None,
        stdin: int = subprocess.DEVNULL,
        host: Any = None,
    ) -> tuple[subprocess.Popen[bytes], Path, Path]:
        """Start ``args``; ``host``: a :class:`netns.Host` to run it on (its namespace,
        its address advertised to peers)."""
        self._n += 1
        env = dict(env or child_env())
        if host is not None:
            args = host.wrap(args)
            env["PHALANX_ADVERTISE_HOST"] = host.ip
        out = self.workdir / f"{label}.{self._n}.out"
        err = self.workdir / f"{label}.{self._n}.err"
        with out.open("wb") as fo, err.open("wb") as fe:
            p = subprocess.Popen(
                args,
                stdout=fo,
                stderr=fe,
                stdin=stdin,
                env=env,
                start_new_session=True,
            )
        self.started.append(p)
        return p, out, err

    def cleanup(self) -> None:
        for p in self.started:
            if p.poll() is None:
                signal_group(p, signal.SIGKILL)  # works on a SIGSTOPped group too
        for p in self.started:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


def signal_group(p: subprocess.Popen[bytes], sig: int) -> None:
    """Send ``sig`` to the process group of ``p`` (which leads its own session)."""
    try:
        os.killpg(p.pid, sig)
    except ProcessLookupError:
        pass


class Controller:
    """A ``phalanx controller`` subprocess on a state dir, and an HTTP view of it."""

    def __init__(
        self,
        procs: Procs,
        state_dir: Path,
        config: Path,
        args: list[str] | None = None,
        env: dict[str, str] | None = None,
        host: Any = None,
    ):
        self.procs = procs
        self.host = host
        """A :class:`netns.Host` to run on (bound to its address), or None: loopback."""
        self.state_dir = state_dir
        self.config = config
        self.args = list(args or [])
        """More ``phalanx controller`` arguments (``--fresh``)."""
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None
        self.err: Path | None = None
        self.url = ""
        self.token = ""

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def launch(self) -> tuple[subprocess.Popen[bytes], Path, Path]:
        """Start a controller process on this state dir without waiting for it."""
        args = [sys.executable, "-m", "phalanx.cli", "controller", "--config", str(self.config)]
        args += ["--state-dir", str(self.state_dir), "--port", "0", *self.args]
        if self.host is not None:
            args += ["--host", self.host.ip]
        return self.procs.spawn(args, "controller", self.env, host=self.host)

    def start(self, timeout: float = 20.0) -> Controller:
        """Start the controller and wait until it listens. Works for a restart too:
        it waits for this process's own announcement, not for a stale url file."""
        self.proc, out, err = self.launch()
        self.err = err
        proc = self.proc

        def announced() -> str | None:
            if proc.poll() is not None:
                raise AssertionError(
                    f"controller exited with {proc.returncode}:\n{err.read_text()}"
                )
            m = re.search(r" at (https?://\S+)", out.read_text())
            return m.group(1) if m else None

        url = wait_for(announced, timeout, "the controller to announce its URL")
        self.url = (self.state_dir / "url").read_text().strip()
        assert self.url == url, f"url file {self.url!r} != announced {url!r}"
        self.token = (self.state_dir / "token").read_text().strip()
        return self

    def kill(self, sig: int = signal.SIGKILL) -> None:
        assert self.proc is not None
        signal_group(self.proc, sig)
        self.proc.wait(timeout=10)

    # -- HTTP --------------------------------------------------------------

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def get(self, path: str, **kw: Any) -> httpx.Response:
        kw.setdefault("headers", self.auth())
        return httpx.get(self.url + path, timeout=10, **kw)

    def post(self, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        kw.setdefault("headers", self.auth())
        if body is not None:
            kw["json"] = body
        return httpx.post(self.url + path, timeout=10, **kw)

    def status(self) -> dict[str, Any]:
        r = self.get("/v1/status")
        assert r.status_code == 200, r.text
        return r.json()

    def members(self, role: str = "policy") -> list[str]:
        return [m["replica_id"] for m in self.status()["roles"][role]["replicas"]]

    def evictions(self, replica_id: str) -> list[dict[str, Any]]:
        return [
            e
            for e in self.status()["events"]
            if e["kind"] == "evict" and e.get("replica_id") == replica_id
        ]


class Replica:
    """A ``replica_proc.py`` subprocess; :meth:`lines` are the quorums it printed."""

    def __init__(
        self,
        procs: Procs,
        controller: Controller | str,
        name: str,
        step_delay: float,
        env: dict[str, str] | None = None,
    ):
        """``controller``: a controller (its state dir), or controller URLs (a
        comma-separated list; ``env`` then holds the token)."""
        self.name = name
        where = controller if isinstance(controller, str) else str(controller.state_dir)
        args = [sys.executable, str(REPLICA_SCRIPT), "--controller", where]
        args += ["--name", name, "--step-delay", str(step_delay)]
        self.proc, self.out, self.err = procs.spawn(args, f"replica-{name}", env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def lines(self) -> list[dict[str, Any]]:
        # Only newline-terminated lines: the last one may be half written.
        complete = self.out.read_text().split("\n")[:-1]
        return [json.loads(line) for line in complete if line.startswith("{")]

    def last(self) -> dict[str, Any] | None:
        lines = self.lines()
        return lines[-1] if lines else None

    def replica_id(self) -> str | None:
        last = self.last()
        return last["replica_id"] if last else None

    def signal(self, sig: int) -> None:
        signal_group(self.proc, sig)

    def wait_line(
        self, pred: Callable[[dict[str, Any]], bool], timeout: float, what: str, after: int = 0
    ) -> dict[str, Any]:
        """Wait for a printed quorum line (from index ``after`` on) that satisfies ``pred``."""

        def find() -> dict[str, Any] | None:
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"replica {self.name} exited with {self.proc.returncode}:\n"
                    f"{self.err.read_text()[-3000:]}"
                )
            return next((x for x in self.lines()[after:] if pred(x)), None)

        return wait_for(find, timeout, f"replica {self.name}: {what}")


def check_history(lines: list[dict[str, Any]]) -> None:
    """One replica's quorums: rounds strictly increase, quorum ids never go
    backwards, the replica is in every quorum it reports, and no step is lost
    or repeated: every round of the job trains exactly the next step, so the
    step is always ``round - 1`` (a joiner heals to it)."""
    for prev, cur in pairwise(lines):
        assert cur["round"] > prev["round"], (prev, cur)
        assert cur["quorum_id"] >= prev["quorum_id"], (prev, cur)
    for line in lines:
        assert line["replica_id"] in line["members"], line
        assert line["step"] == line["round"] - 1, line


def check_rounds(histories: list[list[dict[str, Any]]]) -> dict[int, dict[str, Any]]:
    """All replicas' quorums together: replicas that report the same round agree
    on it, and rounds, quorum ids and steps never go backwards. Returns the
    rounds by number."""
    rounds: dict[int, dict[str, Any]] = {}
    for lines in histories:
        check_history(lines)
        for line in lines:
            seen = rounds.setdefault(line["round"], line)
            for key in ("quorum_id", "step", "members"):
                assert seen[key] == line[key], (seen, line)
    ordered = [rounds[r] for r in sorted(rounds)]
    for prev, cur in pairwise(ordered):
        assert cur["quorum_id"] >= prev["quorum_id"], (prev, cur)
        if cur["members"] == prev["members"] and cur["round"] == prev["round"] + 1:
            assert cur["quorum_id"] == prev["quorum_id"], (prev, cur)
    return rounds


def run_to_end(
    args: list[str],
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(args, capture_output=True, text=True)`` for a command that starts
    processes of its own (``phalanx run``: a zygote, replicas, a controller, each in its
    own session), in a session of its own. Past ``timeout`` it is stopped as a user stops
    it (SIGTERM: the launcher stops what it started), then SIGKILLed with its group, and
    TimeoutExpired raised: ``subprocess.run`` SIGKILLs only the launcher, and what it had
    started lived on past the test (a chaos run's controller, still restarted an hour
    later, loading every test after it)."""
    p = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env() if env is None else env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.terminate()
        try:
            p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
        raise
    return subprocess.CompletedProcess(args, p.returncode, out, err)


def start_run(args: list[str]) -> subprocess.Popen[str]:
    """``python -m phalanx.cli run ARGS`` as a user starts it, in a session of its own,
    its output piped (read it with :func:`finish_run`)."""
    return subprocess.Popen(
        [sys.executable, "-m", "phalanx.cli", "run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
        start_new_session=True,
    )


def finish_run(p: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    """Its stdout and stderr once it exits; past ``timeout`` it is stopped (SIGTERM:
    the launcher stops its replicas and controller) and TimeoutExpired raised."""
    try:
        return p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            p.terminate()
            p.communicate(timeout=30)

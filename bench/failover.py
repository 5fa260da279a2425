"""Failover benchmark: how long an FT job goes without a controller when the one it
talks to is SIGKILLed, with hot standbys on an etcd journal against today's
supervised restart of a lone SQLite controller, in the same run.

    python bench/failover.py [--json] [--trials 3] [--replicas 2]

Each trial runs the FT MLP job (``examples/ft_mlp.toml``, ``--replicas`` replicas,
no end in sight) from real ``phalanx replica`` processes, lets it commit a few
steps, SIGKILLs the controller that leads, and waits for the job to commit again:

- ``standby`` arm: a local etcd (``launch/controllers/etcd.py``) and 3 controllers
  (``launch/controllers/group.py``, as ``phalanx run --controllers 3 --journal
  etcd`` runs them; default timeouts: a 2 s lease, standbys probing the leader's
  port every 50 ms). The replicas are given every URL.
- ``restart`` arm: one controller on SQLite, restarted by its supervisor
  (``launch/supervise.py``, as ``phalanx run`` does) on its state dir and port.

Figures, per trial and as medians (``--json``: one object per line, per trial, then
a summary with ``n``, the replicas):

- ``failover_s`` (standby) / ``restart_s`` (restart): from the SIGKILL to the first
  quorum the next controller formed (the ``at`` of the first ``quorum`` event after
  the kill in its status). Goal: ``failover_s`` <= 1.0.
- ``stall_s``: the job's longest gap between consecutive commits (the replicas'
  ``step`` lines, the first ``t`` of each step) from 5 s before the kill to 10 s
  after it. Goal (standby) <= 1.5.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import secrets
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from phalanx import env
from phalanx.launch.controllers.group import ControllerGroup
from phalanx.launch.procs import spawn, stop_all
from phalanx.launch.supervise import ControllerProcess

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "ft_mlp.toml"
BEFORE_KILL = 15
"""Steps the job commits under the first controller before the kill."""
AFTER_KILL = 15
"""Steps it must commit after the kill for a trial to count."""
TIMEOUT_S = 120.0


def _get(url: str, path: str, token: str) -> Any:
    r = httpx.get(f"{url}{path}", headers={"Authorization": f"Bearer {token}"}, timeout=2.0)
    r.raise_for_status()
    return r.json()


def _wait(what: str, cond: Any, timeout: float = TIMEOUT_S, every: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise SystemExit(f"bench/failover.py: {what} did not happen within {timeout:.0f} s")
        time.sleep(every)


def _steps(logs: list[Path]) -> dict[int, float]:
    """Each committed step and the first time any replica committed it."""
    first: dict[int, float] = {}
    for log in logs:
        try:
            lines = log.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if not line.startswith("{"):
                continue
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if ev.get("event") == "step":
                s, t = int(ev["step"]), float(ev["t"])
                first[s] = min(first.get(s, t), t)
    return first


def _leader(urls: list[str], token: str, other_than: str = "") -> str | None:
    for url in urls:
        if url == other_than:
            continue
        try:
            if _get(url, "/healthz", token).get("role", "leader") == "leader":
                return url
        except (httpx.HTTPError, ValueError):
            continue
    return None


def _first_quorum_after(url: str, token: str, t_kill: float) -> float | None:
    try:
        st = _get(url, "/v1/status", token)
    except (httpx.HTTPError, ValueError):
        return None
    ats = [e["at"] for e in st.get("events", []) if e["kind"] == "quorum" and e["at"] > t_kill]
    return min(ats) - t_kill if ats else None


def trial(arm: str, tmp: Path, replicas: int, token: str) -> dict[str, Any]:
    run = tmp / f"{arm}-{time.monotonic_ns()}"
    run.mkdir(parents=True)
    job = f"failover-{arm}-{secrets.token_hex(3)}"
    args = ["--config", str(CONFIG), f"--job.id={job}"]
    args += [f"--roles.policy.n_init_replicas={replicas}", "--train.steps=1000000"]
    ctls: Any
    if arm == "standby":
        ctls = ControllerGroup(run, args, 3, local_etcd=True)
    else:
        ctls = ControllerProcess(run / "controller", args, run / "controller.log")
    procs = []
    try:
        ctls.start()
        urls = ctls.url.split(",")
        target = ctls.url if arm == "standby" else str(run / "controller")
        logs = [run / f"r{i}.log" for i in range(replicas)]
        for i, log in enumerate(logs):
            cmd = [sys.executable, "-m", "phalanx.cli", "replica", "--role", "policy"]
            cmd += ["--name", f"r{i}", "--controller", target, *args]
            procs.append(spawn(cmd, log))
        _wait("the first steps", lambda: len(_steps(logs)) >= BEFORE_KILL)
        leader = _leader(urls, token) or urls[0]
        victim = ctls.procs[urls.index(leader)] if arm == "standby" else ctls
        assert victim.proc is not None
        t_kill = time.time()
        os.killpg(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        if arm == "standby":
            new = _wait("a new leader", lambda: _leader(urls, token, other_than=leader))
        else:
            # The supervisor's loop: it sees the exit, starts it again, and says when
            # it answers ("controller back at URL").
            _wait("the restart", lambda: (ctls.check() or "").startswith("controller back"))
            new = ctls.url
        took = _wait("a quorum after the kill", lambda: _first_quorum_after(new, token, t_kill))
        last = max(_steps(logs))
        _wait("steps after the kill", lambda: max(_steps(logs)) >= last + AFTER_KILL)
        steps = _steps(logs)
        ts = sorted(t for t in steps.values() if t_kill - 5 <= t <= t_kill + 10)
        stall = max((b - a for a, b in itertools.pairwise(ts)), default=0.0)
        key = "failover_s" if arm == "standby" else "restart_s"
        return {"arm": arm, key: round(took, 3), "stall_s": round(stall, 3), "n": replicas}
    finally:
        stop_all(procs)
        ctls.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--trials", type=int, default=3, help="trials per arm (default 3)")
    p.add_argument("--replicas", type=int, default=2, help="FT replicas (default 2)")
    a = p.parse_args(argv)
    if a.trials < 1 or a.replicas < 1:
        raise SystemExit("bench/failover.py: --trials and --replicas must be >= 1.")
    token = os.environ.setdefault(env.TOKEN, secrets.token_urlsafe(32))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="phalanx-failover-") as d:
        for i in range(a.trials):
            for arm in ("standby", "restart"):  # interleaved: the same load for both
                row = {**trial(arm, Path(d), a.replicas, token), "trial": i}
                rows.append(row)
                print(json.dumps(row) if a.json else row, flush=True)

    def med(arm: str, key: str) -> float:
        return round(statistics.median(r[key] for r in rows if r["arm"] == arm), 3)

    summary = {
        "n": a.replicas,
        "trials": a.trials,
        "failover_s": med("standby", "failover_s"),
        "restart_s": med("restart", "restart_s"),
        "stall_s": med("standby", "stall_s"),
        "restart_stall_s": med("restart", "stall_s"),
        "failover_s_max": max(r["failover_s"] for r in rows if r["arm"] == "standby"),
        "goal_failover_s": 1.0,
        "goal_stall_s": 1.5,
        "machine": f"{platform.node()} {os.cpu_count()} cpus, load {os.getloadavg()[0]:.1f}",
    }
    print(json.dumps(summary) if a.json else summary, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

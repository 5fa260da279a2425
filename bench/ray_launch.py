"""Launch on Ray: ``phalanx run --launcher ray`` against the local launcher, and a
lost Ray node.

    python bench/ray_launch.py [--json] [--steps 30]

A Ray cluster of two nodes on this host (a head with 4 logical CPUs and a
worker with 2, each from ``ray start``: :mod:`phalanx.testing.ray_cluster`,
the GCS marking a lost node dead after ~1.5 s). The job is
``examples/ft_mlp.toml`` with 2 replicas (FT-DDP), in the same run:

- ``local_first_commit_s``: from starting ``phalanx run`` (local launcher,
  zygote on) to the first committed step (the ``t`` of the first step line);
- ``ray_first_commit_s``: the same with ``--launcher ray --ray-address``: the
  replicas are actors spread over both nodes, each starting a fresh
  interpreter (no zygote);
- ``node_kill_stall_s``: a longer Ray job; once both replicas commit, the
  worker node's raylet is SIGKILLed (its replica goes with it): from the kill
  to the survivor's first commit without the lost replica (one participant);
  ``step_s`` is the median gap between commits before the kill, for scale;
- ``node_kill_rejoin_s``: from the kill to the first commit of the lost
  replica's new incarnation, restarted on the head once Ray reported its
  actor dead.

``cluster_start_s`` (the two ``ray start``, not part of any figure above) is
printed too. Every Ray process is stopped through its own process group.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from phalanx.testing.ray_cluster import RAY_ENV, Cluster

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "ft_mlp.toml"
WAIT_S = 300.0


def steps_of(run_dir: Path) -> list[dict[str, Any]]:
    """Every step line the launcher logged for its replicas, by commit time."""
    out = []
    for log in run_dir.glob("policy-*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"event": "step"' in line:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
    return sorted(out, key=lambda e: float(e["t"]))


def start(run_dir: Path, steps: int, extra: list[str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "phalanx.cli", "run", str(CONFIG), "--plain", "--replicas", "2"]
    cmd += ["--run-dir", str(run_dir), "--train.steps", str(steps), *extra]
    return subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=(run_dir.parent / f"{run_dir.name}.err").open("wb"),
        env={**os.environ, **RAY_ENV},
        start_new_session=True,
    )


def wait(what: str, fn: Any, proc: subprocess.Popen[bytes]) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        got = fn()
        if got:
            return got
        if proc.poll() is not None and not fn():
            raise RuntimeError(f"phalanx run exited {proc.returncode} before {what}")
        time.sleep(0.05)
    raise RuntimeError(f"no {what} within {WAIT_S:.0f} s")


def first_commit(run_dir: Path, steps: int, extra: list[str]) -> float:
    """Seconds from starting ``phalanx run`` to its first committed step; the run
    goes on to its end."""
    t0 = time.time()
    proc = start(run_dir, steps, extra)
    try:
        first = wait("a committed step", lambda: steps_of(run_dir), proc)[0]
        if proc.wait(WAIT_S) != 0:
            raise RuntimeError(f"phalanx run exited {proc.returncode}; see {run_dir}")
    finally:
        stop(proc)
    return float(first["t"]) - t0


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, 15)  # the launcher stops its replicas and controller
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def node_kill(cluster: Cluster, run_dir: Path) -> tuple[float, float, float]:
    worker = cluster.nodes[1]
    proc = start(run_dir, 1_000_000, ["--launcher", "ray", "--ray-address", cluster.address])
    try:
        before = wait("commits of both replicas", lambda: _both(run_dir), proc)
        wait("a replica on the worker node", lambda: worker.hosts("phalanx replica"), proc)
        ids = {e["replica"] for e in before}
        t_kill = time.time()
        worker.lose()
        after = wait(
            "the survivor's commit without the lost replica",
            lambda: [
                e
                for e in steps_of(run_dir)
                if float(e["t"]) > t_kill and int(e["participants"]) == 1
            ],
            proc,
        )
        rejoined = wait(
            "the lost replica's new incarnation to commit",
            lambda: [e for e in steps_of(run_dir) if e["replica"] not in ids],
            proc,
        )
    finally:
        stop(proc)
    ts = sorted(float(e["t"]) for e in before if e["replica"] == before[0]["replica"])
    gaps = sorted(b - a for a, b in itertools.pairwise(ts))
    return float(after[0]["t"]) - t_kill, float(rejoined[0]["t"]) - t_kill, gaps[len(gaps) // 2]


def _both(run_dir: Path) -> list[dict[str, Any]]:
    steps = steps_of(run_dir)
    return steps if len({e["replica"] for e in steps}) >= 2 and len(steps) >= 10 else []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="end with one JSON object")
    p.add_argument("--steps", type=int, default=30, help="steps of the first-commit jobs")
    args = p.parse_args(argv)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="phalanx-ray-bench-") as tmp:
        root = Path(tmp)
        out["local_first_commit_s"] = round(first_commit(root / "local", args.steps, []), 2)
        print(f"local launcher: first commit {out['local_first_commit_s']} s", flush=True)
        t0 = time.monotonic()
        with Cluster(root / "ray", head_cpus=4) as cluster:
            cluster.add_worker(cpus=2)
            cluster.wait_nodes(2)
            out["cluster_start_s"] = round(time.monotonic() - t0, 1)
            print(f"ray cluster of 2 nodes up in {out['cluster_start_s']} s", flush=True)
            ray_args = ["--launcher", "ray", "--ray-address", cluster.address]
            out["ray_first_commit_s"] = round(
                first_commit(root / "ray-run", args.steps, ray_args), 2
            )
            print(f"ray launcher: first commit {out['ray_first_commit_s']} s", flush=True)
            stall, rejoin, step = node_kill(cluster, root / "kill")
            out["node_kill_stall_s"], out["node_kill_rejoin_s"] = round(stall, 2), round(rejoin, 2)
            out["step_s"] = round(step, 3)
            print(
                f"worker node lost: survivor's next commit after {stall:.2f} s; the lost "
                f"replica's new incarnation committed after {rejoin:.2f} s",
                flush=True,
            )
    out["load_avg_1m"] = round(os.getloadavg()[0], 2)
    if args.json:
        print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

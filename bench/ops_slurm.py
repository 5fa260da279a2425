"""Slurm benchmark (issue 40): how long a job takes to commit its first step under
``sbatch deploy/slurm/phalanx.sbatch`` on a real Slurm cluster, against the same job
under ``phalanx run`` on this machine.

    python bench/ops_slurm.py [--json] [--slurm-steps 20] [--slurm-repeats 3]

One run: a real cluster on this host (:mod:`phalanx.testing.slurm`: munged,
``slurmctld`` and slurmd "nodes"; root, and Slurm installed by ``make install``),
started once and not timed; then, ``--slurm-repeats`` times each, alternating, the built-in
FT job (``examples/ft_mlp.toml``, two policy replicas, ``--slurm-steps`` steps):

- ``slurm_first_commit_s``: from ``sbatch`` to the first committed step a replica
  printed (its agent's worker's ``rank0.out`` in the job dir), with the script as its
  header says to edit it for a job without rollout replicas (one node per replica,
  no hetjob). It holds Slurm's scheduling of the job, the batch script, the
  controller's step (``phalanx agent --serve-controller``), the agents' steps and
  their replicas' start (each a fresh interpreter), the first quorum and the step.
- ``local_first_commit_s``: from ``phalanx run`` to the first committed step in a
  replica's log (``--replicas 2``, the same overrides; its replicas fork from a
  zygote that did the imports once).
- ``slurm_first_commit_ratio``: the first over the second.
- ``slurm_jobs_ok``: every Slurm job ended COMPLETED and every local one exited 0.

Figures are medians over the repeats. Every process is stopped by its pid: the
cluster's daemons by :meth:`SlurmCluster.stop`, ``phalanx run`` (which ends its
children by process group) by waiting for it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from phalanx.testing.slurm import (  # noqa: E402
    SlurmCluster,
    missing,
    steps_seen,
    wait_until,
)

CONFIG = ROOT / "examples" / "ft_mlp.toml"
REPLICAS = 2
"""Policy replicas of each job: one per node of the Slurm job's two."""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--slurm-steps", type=int, default=20, help="steps of each job")
    p.add_argument("--slurm-repeats", type=int, default=3, help="jobs of each kind (median)")


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONUNBUFFERED"] = "1"
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), e.get("PYTHONPATH", "")) if p)
    return e


def local_steps(run_dir: Path) -> list[int]:
    """The steps ``phalanx run``'s replicas have printed as committed so far."""
    out = []
    for log in run_dir.glob("policy-*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith('{"event": "step"'):
                out.append(int(json.loads(line)["step"]))
    return out


def local_job(tmp: Path, steps: int) -> tuple[float, bool]:
    """One ``phalanx run``: (seconds to its first committed step, it exited 0)."""
    run_dir = tmp / f"local-{time.monotonic_ns()}"
    args = [sys.executable, "-m", "phalanx.cli", "run", str(CONFIG), "--plain"]
    args += ["--run-dir", str(run_dir), "--replicas", str(REPLICAS), f"--train.steps={steps}"]
    t0 = time.monotonic()
    with (tmp / "local.out").open("ab") as out:
        p = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=env(), cwd=ROOT)
        try:
            wait_until(
                lambda: local_steps(run_dir) or p.poll() is not None,
                300,
                "phalanx run's first step",
                every=0.02,
            )
            first = time.monotonic() - t0
            ok = p.wait(timeout=600) == 0 and bool(local_steps(run_dir))
        finally:
            if p.poll() is None:
                p.terminate()  # phalanx run ends its children by process group
                p.wait(timeout=60)
    return first, ok


def slurm_job(cluster: SlurmCluster, tmp: Path, steps: int) -> tuple[float, bool]:
    """One ``sbatch`` of the same job: (seconds to its first committed step, it ended
    COMPLETED)."""
    work = tmp / f"slurm-{time.monotonic_ns()}"
    work.mkdir()
    t0 = time.monotonic()
    job, job_dir = cluster.submit(
        work, CONFIG, f"--train.steps={steps}", groups=(REPLICAS,), env=env()
    )
    done = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL")
    wait_until(
        lambda: steps_seen(job_dir) or cluster.job_state(job) in done,
        300,
        f"job {job}'s first step",
        every=0.02,
    )
    first = time.monotonic() - t0
    return first, cluster.wait_job(job, 600) == "COMPLETED" and bool(steps_seen(job_dir))


def measure(args: argparse.Namespace) -> dict[str, float | int | str]:
    why = missing()
    if why is not None:
        raise SystemExit(f"bench/ops_slurm.py needs a Slurm cluster on this host: {why}")
    if args.slurm_steps < 1 or args.slurm_repeats < 1:
        raise SystemExit(
            f"--slurm-steps and --slurm-repeats must be >= 1: got {args.slurm_steps} and {args.slurm_repeats}."
        )
    with tempfile.TemporaryDirectory(prefix="ops-slurm-") as name:
        tmp = Path(name)
        cluster = SlurmCluster(tmp / "cluster")
        slurm_s, local_s, ok = [], [], True
        try:
            cluster.start()
            for _ in range(args.slurm_repeats):
                s, s_ok = slurm_job(cluster, tmp, args.slurm_steps)
                loc, l_ok = local_job(tmp, args.slurm_steps)
                slurm_s.append(s)
                local_s.append(loc)
                ok = ok and s_ok and l_ok
        finally:
            cluster.stop()
    slurm_med, local_med = statistics.median(slurm_s), statistics.median(local_s)
    out: dict[str, Any] = {
        "slurm_first_commit_s": round(slurm_med, 3),
        "local_first_commit_s": round(local_med, 3),
        "slurm_first_commit_ratio": round(slurm_med / local_med, 3),
        "slurm_jobs_ok": int(ok),
        "slurm_repeats": args.slurm_repeats,
    }
    return out


def main(argv: list[str] | None = None) -> int:
    from ops import part_main  # beside this file, on the path of a script run from bench/

    return part_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())

"""Stragglers benchmark (issue 40): what one half-speed replica costs a step, before
and after the controller gives it a smaller share.

    python bench/ops_straggler.py [--json] [--replicas 4] [--steps 40]
                                  [--step-delay-s 0.01]

Two ``phalanx run`` jobs of the built-in FT job (``examples/ft_mlp.toml``) in one
run, on the same machine, one after the other: a calm one, and one whose replica
``policy-<N-1>`` computes its share at half speed (``train.slowdown = 2``: each
micro-batch takes twice as long, in proportion to its work, like a throttled
device). Both with ``[controller.stragglers]`` on (window 3), exact reduction, a
global batch of 12 samples per replica in micro-batches of 1 sample, each
``--step-delay-s`` long (a stand-in for a bigger model: the step is compute-bound,
as a real one is).

Figures (medians of the step intervals of ``policy-0``'s committed steps, from the
``t`` of its step lines):

- ``calm_step_s``: the calm job's step.
- ``straggler_step_ratio_before``: the slowed job's step before its straggler's share
  shrank (the steps of the detection window) over the calm step: about 2 when the
  compute dominates.
- ``straggler_step_ratio``: the slowed job's step after it (from the second step with
  the smaller share) over the calm step. Goal <= 1.2 (with N replicas, one at half
  speed, the best is N/(N - 1/2) of the calm compute: 1.14 at 4).
- ``straggler_detect_steps``: steps committed before the first smaller share.
- ``straggler_share``: the slowed replica's share then, over an equal one.
- ``straggler_audit_ok``: ``phalanx audit RUN --against CALM`` passed (every step
  once, the calm run's global batches, bit-identical final state).
- ``straggler_report_us``: what the watch costs the controller per report at
  ``--watch-replicas`` (10,000) replicas of one role, each reporting every round
  (the controller's own :class:`~phalanx.controller.core.stragglers.Stragglers`,
  in this process; no job runs).

Every process is ``phalanx run``'s own, which kills its children by process group.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "ft_mlp.toml"
PER_REPLICA = 12
"""Samples per replica in an equal share."""


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=4, help="policy replicas (>= 3)")
    p.add_argument("--steps", type=int, default=40, help="steps of each job")
    p.add_argument("--step-delay-s", type=float, default=0.01, help="per micro-batch (sample)")
    p.add_argument(
        "--watch-replicas", type=int, default=10_000, help="replicas for straggler_report_us"
    )


def overrides(replicas: int, steps: int, delay_s: float, slow: bool) -> list[str]:
    """The job's settings (the calm job's, or the slowed one's with ``slow``)."""
    out = [
        f"--roles.policy.n_init_replicas={replicas}",
        f"--train.steps={steps}",
        f"--train.global_batch_size={PER_REPLICA * replicas}",
        "--train.micro_batch_size=1",
        f"--train.step_delay_s={delay_s}",
        "--train.exact_reduction=true",
        "--train.hidden=[32]",
        "--controller.stragglers.enabled=true",
        "--controller.stragglers.window=3",
    ]
    if slow:
        out += [f"--train.slow_replica=policy-{replicas - 1}", "--train.slowdown=2"]
    return out


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["OMP_NUM_THREADS"] = "1"
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), e.get("PYTHONPATH", "")) if p)
    return e


def run_job(run_dir: Path, more: list[str], timeout_s: float = 600) -> None:
    """``phalanx run`` to its end; raises with its output's tail when it fails."""
    args = [sys.executable, "-m", "phalanx.cli", "run", str(CONFIG), "--plain", "--json"]
    args += ["--run-dir", str(run_dir), *more]
    p = subprocess.run(args, capture_output=True, text=True, env=env(), timeout=timeout_s)
    if p.returncode != 0:
        raise RuntimeError(f"phalanx run failed ({p.returncode}): {p.stderr[-2000:]}")


def steps_of(run_dir: Path, replica: str) -> list[dict[str, Any]]:
    """``replica``'s committed step lines, in order (the last of each step)."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in (run_dir / f"{replica}.log").read_text().splitlines():
        if line.startswith('{"event": "step"'):
            e = json.loads(line)
            by_step[int(e["step"])] = e
    return [by_step[s] for s in sorted(by_step)]


def intervals(steps: list[dict[str, Any]], first: int, last: int) -> list[float]:
    """Step intervals of the steps numbered ``first..last`` (each from the step before)."""
    t = {int(e["step"]): float(e["t"]) for e in steps}
    return [t[s] - t[s - 1] for s in range(first, last + 1) if s in t and s - 1 in t]


def audit(run_dir: Path, calm: Path) -> dict[str, Any]:
    """``phalanx audit RUN --against CALM --json``'s verdict."""
    args = [sys.executable, "-m", "phalanx.cli", "audit", str(run_dir), "--against", str(calm)]
    p = subprocess.run([*args, "--json"], capture_output=True, text=True, env=env(), timeout=300)
    out = json.loads(p.stdout.strip().splitlines()[-1]) if p.stdout.strip() else {}
    return {"rc": p.returncode, **out}


def figures(calm: Path, slowed: Path, replicas: int) -> dict[str, Any]:
    """The figures of a calm run and a slowed run (directories of ``phalanx run``)."""
    fast, slow = "policy-0", f"policy-{replicas - 1}"
    calm_steps, steps = steps_of(calm, fast), steps_of(slowed, fast)
    last = len(calm_steps)
    calm_s = statistics.median(intervals(calm_steps, 3, last))
    equal = PER_REPLICA
    smaller = [int(e["step"]) for e in steps_of(slowed, slow) if len(e["samples"]) < equal]
    if not smaller:
        return {"calm_step_s": round(calm_s, 4), "straggler_detect_steps": -1}
    first = smaller[0]
    share = len(next(e for e in steps_of(slowed, slow) if int(e["step"]) == first)["samples"])
    before = statistics.median(intervals(steps, 3, first - 1) or [float("nan")])
    after = statistics.median(intervals(steps, first + 2, len(steps)))
    return {
        "calm_step_s": round(calm_s, 4),
        "straggler_step_ratio_before": round(before / calm_s, 3),
        "straggler_step_ratio": round(after / calm_s, 3),
        "straggler_detect_steps": first - 1,
        "straggler_share": round(share / equal, 3),
    }


def report_us(replicas: int, rounds: int = 8) -> float:
    """Microseconds per report of the controller's straggler watch, ``replicas`` of one
    role reporting share times (within 10 % of each other) for ``rounds`` rounds."""
    import random
    import time

    from phalanx.config import load_config
    from phalanx.controller.core.base import ChangeLog
    from phalanx.controller.core.stragglers import Stragglers

    cfg = load_config(overrides=["controller.stragglers.enabled=true"]).controller.stragglers
    watch, rng = Stragglers(cfg, ChangeLog(history=1000)), random.Random(1)
    ids = [f"policy-{i}:x" for i in range(replicas)]
    t0 = time.perf_counter()
    for r in range(rounds):
        for rid in ids:
            watch.report(rid, rid[:-2], "policy", str(r), rng.uniform(0.9, 1.1), 8, wall=r)
    return (time.perf_counter() - t0) / (rounds * replicas) * 1e6


def measure(args: argparse.Namespace) -> dict[str, float | int | str]:
    if args.replicas < 3:
        raise SystemExit(f"--replicas must be >= 3 (a median of peers): got {args.replicas}.")
    with tempfile.TemporaryDirectory(prefix="ops-straggler-") as tmp:
        calm, slowed = Path(tmp) / "calm", Path(tmp) / "slowed"
        run_job(calm, overrides(args.replicas, args.steps, args.step_delay_s, False))
        run_job(slowed, overrides(args.replicas, args.steps, args.step_delay_s, True))
        out: dict[str, Any] = figures(calm, slowed, args.replicas)
        verdict = audit(slowed, calm)
    out["straggler_audit_ok"] = int(verdict.get("rc") == 0)
    out["straggler_replicas"] = args.replicas
    out["straggler_report_us"] = round(report_us(args.watch_replicas), 1)
    return out


def main(argv: list[str] | None = None) -> int:
    from ops import part_main  # beside this file, on the path of a script run from bench/

    return part_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())

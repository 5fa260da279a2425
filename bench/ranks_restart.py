"""How fast a replica of several ranks comes back under ``phalanx run``: ranks
forked from the zygote against ranks started as fresh interpreters, in one run.

    python bench/ranks_restart.py [--json] [--steps 400] [--kill-every 20]

Both arms run ``phalanx run examples/ft_hsdp.toml --chaos kill-every=K,seed=1
--train.steps N --plain`` (3 replicas of 2 ranks, a whole replica SIGKILLed at
most every K seconds); the baseline adds ``--no-zygote``, which is how every
replica of several ranks started before its ranks were forked (fresh
interpreters that import torch and the job themselves). From each arm's
console lines:

- ``back_s``: for each restart, from the ``restarted`` line to that replica's
  ``healed`` line (its ranks start, register, build FSDP2 and heal); the
  median over the run's restarts;
- ``first_step_s``: from the launch to the first ``step`` line;
- ``wall_s``: the whole job, and ``final_loss`` (the same in both arms: the
  same global batches whoever fails).

``back_ratio`` is the forked arm's ``back_s`` over the baseline's.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ft_hsdp.toml"
LINE = re.compile(r"^\s*([\d.]+)s\s+(.*)$")


def arm(extra: list[str], steps: int, kill_every: float) -> dict[str, Any]:
    run_dir = tempfile.mkdtemp(prefix="bench-ranks-")
    cmd = [sys.executable, "-m", "phalanx.cli", "run", str(EXAMPLE), "--plain"]
    cmd += ["--chaos", f"kill-every={kill_every},seed=1", "--train.steps", str(steps)]
    cmd += ["--run-dir", run_dir, *extra]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    wall = time.monotonic() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{cmd} exited {p.returncode}: {p.stdout[-2000:]}{p.stderr[-2000:]}")
    first, restarted, backs = None, {}, []
    for raw in p.stdout.splitlines():
        m = LINE.match(raw)
        if not m:
            continue
        t, text = float(m.group(1)), m.group(2)
        if first is None and text.startswith("step"):
            first = t
        if text.endswith(" restarted"):
            restarted[text.split()[0]] = t
        if " healed to step " in text and text.split()[0] in restarted:
            backs.append(t - restarted.pop(text.split()[0]))
    loss = re.search(r"final loss ([\d.]+)", p.stdout)
    return {
        "back_s": statistics.median(backs) if backs else None,
        "restarts": len(backs),
        "first_step_s": first,
        "wall_s": wall,
        "final_loss": float(loss.group(1)) if loss else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--kill-every", type=float, default=20.0)
    args = ap.parse_args(argv)
    out: dict[str, Any] = {}
    for name, extra in (("forked", []), ("fresh", ["--no-zygote"])):
        for k, v in arm(extra, args.steps, args.kill_every).items():
            out[f"{name}_{k}"] = v
    if out["forked_back_s"] and out["fresh_back_s"]:
        out["back_ratio"] = out["forked_back_s"] / out["fresh_back_s"]
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

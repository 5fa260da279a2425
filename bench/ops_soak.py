"""The soak of issue 40: the FT job under a fault every ``--soak-every`` seconds drawn
from all chaos kinds, and how much of its calm throughput it keeps.

    python bench/ops_soak.py [--json] [--soak-s S] [--soak-every S] [--calm-steps N]
                             [--soak-seed N] [--soak-keep DIR] [--soak-set S.K=V ...]

Two runs of ``examples/ft_mlp.toml`` (3 replicas, float32 MLP, global batch 96,
``train.log_samples`` on), one after the other, by ``phalanx run`` as an operator runs
it:

1. calm, ``--calm-steps`` steps (default 300): the calm rate, committed samples per
   second from its first commit to its last (each step's time: the earliest ``t`` of
   its ``step`` lines), so that neither run's start-up counts;
2. the soak, ``phalanx run --chaos all-every=S,seed=N``: as many steps as the calm
   rate commits in ``--soak-s`` seconds (default 300), so the soak lasts about
   ``--soak-s`` / goodput. Every fault lands only while every replica is up and has
   progressed (at most one down at a time: :mod:`phalanx.launch.chaos.faults`).

Figures (``--json``: one object):

- ``soak_goodput`` (goal >= 0.9): the soak's committed samples over (calm samples per
  second x the soak's wall time), both from the first commit to the last;
- ``soak_audit``: ``pass`` when the audit that ends the ``--chaos`` run found no
  violation (:mod:`phalanx.audit`), else ``FAIL``; the bench exits 1 then;
- ``soak_lost_s_<kind>``: what each kind of fault cost, on average: the seconds from
  the fault to the next one, less the calm time of the steps committed in between
  (:func:`fault_costs`), which says what dominates a gap to the goal;
- ``soak_faults`` and ``soak_kinds`` (the kinds delivered, from ``chaos.jsonl``),
  ``soak_steps``, ``soak_wall_s``, ``calm_samples_per_s``, ``soak_s``, ``soak_every_s``,
  ``soak_set`` (the ``--soak-set`` overrides both runs took: the example's config is
  the default; ``timeouts.collective_s`` bounds the stall of a stopped, slowed or cut
  replica, which its peers wait out before they report it).

:func:`measure` and :func:`add_args` are what ``bench/ops.py`` assembles.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FT = ROOT / "examples" / "ft_mlp.toml"
GOAL = 0.9
RUN_TIMEOUT_S = 7200


def add_args(p: argparse.ArgumentParser) -> None:
    """This module's flags (each prefixed ``--soak``/``--calm``: ``bench/ops.py`` puts
    every part's flags on one parser)."""
    p.add_argument("--soak-s", type=float, default=300.0, help="the soak's length at the calm rate")
    p.add_argument("--soak-every", type=float, default=15.0, help="mean seconds between faults")
    p.add_argument("--calm-steps", type=int, default=300, help="steps of the calm run")
    p.add_argument("--soak-seed", type=int, default=1, help="the chaos draws' seed")
    p.add_argument("--soak-keep", type=Path, help="keep both run dirs here (default: a temp dir)")
    p.add_argument(
        "--soak-set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a config override for both runs, as phalanx run takes it (repeatable): "
        "timeouts.collective_s=1.0 bounds what a stopped replica stalls",
    )


def run_ft(
    run_dir: Path, steps: int, chaos: str | None = None, more: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``phalanx run examples/ft_mlp.toml`` for ``steps`` steps (sample ids logged; ``more``:
    further overrides), to its end. Returns its JSON lines by event (``summary``, and
    ``audit`` after ``--chaos``) plus ``returncode`` and ``tail`` (its output's end, for a
    failure's message)."""
    args = [sys.executable, "-m", "phalanx.cli", "run", str(FT), "--plain", "--json"]
    args += ["--run-dir", str(run_dir), "--train.steps", str(steps), *more]
    args += ["--train.log_samples", "true", *(["--chaos", chaos] if chaos else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(args, capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT_S)
    out: dict[str, Any] = {"returncode": p.returncode, "tail": (p.stdout + p.stderr)[-3000:]}
    for line in p.stdout.splitlines():
        if line.startswith('{"event"'):
            ev = json.loads(line)
            out[ev["event"]] = ev
    return out


def commit_times(run_dir: Path) -> dict[int, float]:
    """Each committed step -> when it was committed: the earliest ``t`` of its ``step``
    lines in the policy replicas' logs (a step committed again after a rollback: its
    last commit)."""
    first: dict[tuple[int, int], float] = {}
    for log in run_dir.glob("policy-*.log"):
        for line in log.read_text(errors="replace").splitlines():
            if not line.startswith('{"event": "step"'):
                continue
            with contextlib.suppress(ValueError):
                e = json.loads(line)
                k = (int(e["step"]), int(e.get("quorum_id", 0)))
                first[k] = min(first.get(k, e["t"]), e["t"])
    out: dict[int, float] = {}
    for (step, _q), t in sorted(first.items()):
        out[step] = t
    return out


def window(run_dir: Path) -> tuple[int, float]:
    """Steps committed after the first commit, and the seconds from it to the last."""
    times = commit_times(run_dir)
    if len(times) < 2:
        raise RuntimeError(f"{run_dir}: fewer than 2 committed steps in the policy logs")
    a, b = min(times), max(times)
    return b - a, times[b] - times[a]


def fault_costs(
    times: dict[int, float], faults: list[dict[str, Any]], step_s: float
) -> dict[str, float]:
    """Kind -> the mean seconds a fault of that kind cost: from the fault to the next (the
    last: to the last commit), the wall time less ``step_s`` x the steps committed in it."""
    at = sorted(times.values())
    lost: dict[str, list[float]] = {}
    for i, f in enumerate(faults):
        a = f["t"]
        b = faults[i + 1]["t"] if i + 1 < len(faults) else at[-1]
        n = bisect.bisect(at, b) - bisect.bisect(at, a)
        lost.setdefault(f["kind"], []).append(max(0.0, b - a) - n * step_s)
    return {k: round(sum(v) / len(v), 2) for k, v in sorted(lost.items())}


def batch_of(run_dir: Path) -> int:
    cfg = json.loads((run_dir / "controller" / "config.json").read_text())
    return int(cfg["train"]["global_batch_size"])


def overrides(sets: list[str]) -> tuple[str, ...]:
    """``--soak-set`` values as ``phalanx run`` flags; one line for one not KEY=VALUE."""
    bad = [x for x in sets if "=" not in x or "." not in x.split("=", 1)[0]]
    if bad:
        raise SystemExit(
            f"ops_soak: --soak-set takes SECTION.KEY=VALUE (timeouts.collective_s=1.0): got "
            f"{', '.join(map(repr, bad))}."
        )
    return tuple(f"--{x}" for x in sets)


def measure(args: argparse.Namespace) -> dict[str, float | int | str]:
    """The calm run, then the soak; the figures of the module docstring."""
    if args.soak_s <= 0 or args.soak_every <= 0 or args.calm_steps < 10:
        raise SystemExit(
            f"ops_soak: --soak-s and --soak-every must be > 0 and --calm-steps >= 10: got "
            f"{args.soak_s:g}, {args.soak_every:g}, {args.calm_steps}."
        )
    with contextlib.ExitStack() as stack:
        if args.soak_keep:
            tmp = Path(args.soak_keep)
            tmp.mkdir(parents=True, exist_ok=True)
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="phalanx-soak-")))
        more = overrides(args.soak_set)
        calm = run_ft(tmp / "calm", args.calm_steps, None, more)
        if calm["returncode"] != 0:
            raise RuntimeError(f"the calm run failed: {calm['tail']}")
        batch = batch_of(tmp / "calm")
        n, secs = window(tmp / "calm")
        rate = n * batch / secs
        steps = max(args.calm_steps, round(rate / batch * args.soak_s))
        chaos = f"all-every={args.soak_every:g},seed={args.soak_seed}"
        soak = run_ft(tmp / "soak", steps, chaos, more)
        if soak["returncode"] not in (0, 1) or "summary" not in soak:
            raise RuntimeError(f"the soak failed: {soak['tail']}")
        n, secs = window(tmp / "soak")
        faults = [
            json.loads(x) for x in (tmp / "soak" / "chaos.jsonl").read_text().splitlines() if x
        ] if (tmp / "soak" / "chaos.jsonl").exists() else []  # fmt: skip
        ok = soak["returncode"] == 0 and bool(soak.get("audit", {}).get("ok"))
        costs = fault_costs(commit_times(tmp / "soak"), faults, batch / rate)
        return {
            "soak_goodput": round(n * batch / (rate * secs), 3),
            "soak_audit": "pass" if ok else "FAIL",
            "soak_faults": len(faults),
            "soak_kinds": ",".join(sorted({f["kind"] for f in faults})),
            "soak_steps": steps,
            "soak_wall_s": round(secs, 1),
            "calm_samples_per_s": round(rate, 1),
            "soak_s": args.soak_s,
            "soak_every_s": args.soak_every,
            "soak_set": " ".join(args.soak_set),
            **{f"soak_lost_s_{k.replace('-', '_')}": v for k, v in costs.items()},
        }


def main(argv: list[str] | None = None) -> int:
    from ops import part_main  # beside this file, on the path of a script run from bench/

    return part_main(sys.modules[__name__], argv, ok=lambda out: out["soak_audit"] == "pass")


if __name__ == "__main__":
    sys.exit(main())

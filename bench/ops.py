"""Operations benchmark (issue 40), one run of its three parts, each a module of its
own beside this file:

    python bench/ops.py [--json] [--only PART[,PART]] [each part's flags]

- ``ops_soak``: ``soak_goodput`` (goal >= 0.9), the FT job's committed samples under a
  fault every ``--soak-every`` s drawn from all chaos kinds, over its calm rate;
- ``ops_slurm``: ``slurm_first_commit_s`` against ``local_first_commit_s``, the FT job
  under ``sbatch`` on a real single-machine Slurm cluster and under ``phalanx run``;
- ``ops_straggler``: ``straggler_step_ratio`` (goal <= 1.2), the step time with one
  half-speed replica after detection over the calm step time.

Each part exposes ``add_args(parser)`` (its own flags, on this one parser) and
``measure(args) -> dict`` (its figures, measured against its own baseline in the same
run). The parts run one after another, never side by side (they share the machine),
and their figures are merged into one object (``--json``: one line) or a table. A
part whose module is not here is skipped with a one-line reason in ``skipped``; a
part that fails is reported in ``errors`` (exit 1), and the others still run. Two
parts that give the same figure are refused (:func:`merge`).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the parts, run as a script or not

PARTS = ("ops_soak", "ops_slurm", "ops_straggler")
"""The parts' module names, in the order they run."""
KEYS = {
    "ops_soak": ("soak_goodput",),
    "ops_slurm": ("slurm_first_commit_s", "local_first_commit_s"),
    "ops_straggler": ("straggler_step_ratio",),
}
"""The figures issue 40 asks of each part (a part may give more)."""
GOALS = {"soak_goodput": ">= 0.9", "straggler_step_ratio": "<= 1.2"}

Figures = dict[str, float | int | str]


def load_parts(names: tuple[str, ...] = PARTS) -> tuple[dict[str, ModuleType], dict[str, str]]:
    """The parts' modules that are here, and for each one absent the reason (one line)."""
    found: dict[str, ModuleType] = {}
    skipped: dict[str, str] = {}
    for name in names:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name != name:
                raise  # the part is here but needs something missing: not a skip
            skipped[name] = f"bench/{name}.py is not in this checkout"
            continue
        missing = [f for f in ("add_args", "measure") if not callable(getattr(mod, f, None))]
        if missing:
            skipped[name] = f"bench/{name}.py has no {' or '.join(missing)}()"
            continue
        found[name] = mod
    return found, skipped


def parser(parts: dict[str, ModuleType]) -> argparse.ArgumentParser:
    """This script's flags, then each part's in its own group."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument(
        "--only",
        help=f"comma-separated parts to run (default: all of {', '.join(PARTS)})",
    )
    for name, mod in parts.items():
        mod.add_args(p.add_argument_group(name))
    return p


def chosen(only: str | None, parts: dict[str, ModuleType]) -> list[str]:
    """The parts ``--only`` names (all those here by default); one line for a name that
    is no part."""
    if not only:
        return list(parts)
    names = [x.strip() for x in only.split(",") if x.strip()]
    bad = [x for x in names if x not in PARTS]
    if bad:
        raise SystemExit(f"ops: --only names no part {', '.join(bad)}: write some of {PARTS}.")
    return [x for x in names if x in parts]


def merge(results: dict[str, Figures]) -> Figures:
    """The parts' figures in one dict, in part order. A figure given by two parts would
    hide one of them: refused."""
    out: Figures = {}
    owner: dict[str, str] = {}
    for part, figures in results.items():
        for k, v in figures.items():
            if k in owner:
                raise ValueError(f"ops: figure {k!r} is given by both {owner[k]} and {part}.")
            owner[k] = part
            out[k] = v
    return out


def run(args: argparse.Namespace, parts: dict[str, ModuleType], names: list[str]) -> dict[str, Any]:
    """Each chosen part's :func:`measure`, one after another; the merged figures plus
    ``errors`` (a part that raised, one line each) and ``part_wall_s``."""
    results: dict[str, Figures] = {}
    errors: dict[str, str] = {}
    walls: dict[str, float] = {}
    for name in names:
        t = time.monotonic()
        try:
            results[name] = parts[name].measure(args)
        except (Exception, SystemExit) as e:  # one part's failure must not lose the others
            errors[name] = (str(e).strip().splitlines() or [type(e).__name__])[-1]
        else:
            missing = [k for k in KEYS.get(name, ()) if k not in results[name]]
            if missing:
                errors[name] = f"bench/{name}.py gave no {', '.join(missing)}"
        walls[name] = round(time.monotonic() - t, 1)
    return {**merge(results), "errors": errors, "part_wall_s": walls}


def main(argv: list[str] | None = None) -> int:
    parts, skipped = load_parts()
    p = parser(parts)
    a = p.parse_args(argv)
    names = chosen(a.only, parts)
    for name in PARTS:
        if name in parts and name not in names:
            skipped[name] = "not in --only"
    out = run(a, parts, names)
    out |= {"skipped": skipped, "goals": GOALS}
    out["host"] = f"{platform.node()}: {os.cpu_count()} CPUs, python {platform.python_version()}"
    if not a.json:
        for name, why in skipped.items():
            print(f"skipped {name}: {why}")
        for name, why in out["errors"].items():
            print(f"error in {name}: {why}")
    show({k: v for k, v in out.items() if a.json or k not in ("skipped", "errors")}, a.json)
    return 1 if out["errors"] else 0


def show(figures: dict[str, Any], as_json: bool) -> None:
    """Figures as one JSON line, or as a table of one figure a line."""
    if as_json:
        print(json.dumps(figures))
    else:
        for k, v in figures.items():
            print(f"{k:>24}: {v}")


def part_main(
    part: ModuleType,
    argv: list[str] | None = None,
    ok: Callable[[Figures], bool] = lambda _: True,
) -> int:
    """One part run on its own (``python bench/ops_soak.py [--json] [its flags]``): its
    flags alone, its figures as :func:`show` prints them; exit 1 where ``ok`` says
    its figures fail (the soak's audit, say)."""
    p = argparse.ArgumentParser(
        description=part.__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--json", action="store_true", help="one JSON object")
    part.add_args(p)
    a = p.parse_args(argv)
    out = part.measure(a)
    show(out, a.json)
    return 0 if ok(out) else 1


if __name__ == "__main__":
    sys.exit(main())

"""``phalanx audit RUN_DIR [--against CALM_RUN_DIR] [--json]``: the checks of this
package on a finished run, printed as a table (check, verdict, detail), or as JSON.
``phalanx audit --state-dir DIR LOG [LOG ...] [--final FILE ...]``: the same checks
on a job another launcher started (the served controller's state dir and the
replicas' stdout files; :func:`~.rundir.load_job`).

Exit status: 0 when no check found a violation, 1 on any violation, 2 when
``RUN_DIR`` (or the calm run, or the state dir and outputs) is not a run (one line
naming what is missing). ``phalanx run --chaos`` ends with the same audit
(:func:`after_chaos`).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phalanx.audit.base import FAIL, Check, NotARun, Run

EXIT_VIOLATION, EXIT_BAD_INPUT = 1, 2


def audit_checks(run: Run, calm: Run | None = None) -> list[Check]:
    """Every check of ``run`` (and against ``calm``, when given), in table order."""
    from phalanx.audit.against import check_batches, check_final
    from phalanx.audit.data import check_samples
    from phalanx.audit.ledger import check_balance, check_trained_once
    from phalanx.audit.steps import check_complete, check_finals, check_once, check_order

    checks = [
        check_once(run),
        check_order(run),
        check_complete(run),
        check_samples(run),
        check_finals(run),
        check_balance(run),
        check_trained_once(run),
    ]
    if calm is not None:
        checks += [check_batches(run, calm), check_final(run, calm)]
    return checks


def table(checks: list[Check]) -> str:
    """The checks as an aligned text table."""
    w = max(len("check"), *(len(c.name) for c in checks))
    lines = [f"{'check':<{w}}  verdict  detail"]
    lines += [f"{c.name:<{w}}  {c.verdict:<7}  {c.detail}" for c in checks]
    return "\n".join(lines)


def audit(
    run_dir: Path,
    calm_dir: Path | None = None,
    as_json: bool = False,
    load: Callable[[], Run] | None = None,
) -> int:
    """Audit ``run_dir`` (against ``calm_dir``), print the result; return the exit status.
    ``load``: how to read the run instead (a job outside a run dir: ``run_dir`` is then
    its state dir, named in the output)."""
    from phalanx.audit.rundir import load_run

    try:
        run = load() if load is not None else load_run(run_dir)
        calm = load_run(calm_dir) if calm_dir is not None else None
    except NotARun as e:
        print(f"phalanx audit: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    checks = audit_checks(run, calm)
    bad = any(c.verdict == FAIL for c in checks)
    if as_json:
        doc: dict[str, Any] = {
            "event": "audit",
            "run_dir": str(run_dir) if load is None else None,
            "state_dir": str(run_dir) if load is not None else None,
            "against": str(calm_dir) if calm_dir is not None else None,
            "ok": not bad,
            "checks": [c.as_dict() for c in checks],
        }
        print(json.dumps(doc), flush=True)
    else:
        what = f"the job of {run_dir}" if load is not None else str(run_dir)
        print(f"audit of {what}" + (f" against {calm_dir}" if calm_dir else ""))
        print(table(checks), flush=True)
    return EXIT_VIOLATION if bad else 0


def after_chaos(run_dir: Path, code: int, as_json: bool) -> int:
    """The end of ``phalanx run --chaos``: its run dir audited, after the summary. The
    run's exit status becomes the audit's violation status when the job itself ended
    well; a job that failed keeps its own."""
    if not (run_dir / "controller" / "config.json").is_file():
        return code  # the job never started its controller: nothing to audit
    print(flush=True)
    found = audit(run_dir, None, as_json)
    return code or (EXIT_VIOLATION if found else 0)


def add_parser(sub: Any) -> None:
    """The ``audit`` subcommand of ``phalanx``."""
    a = sub.add_parser(
        "audit",
        help="check a finished run: steps committed once, never backwards, the RL ledger, "
        "and (--against) the calm run's batches and final state",
        description="Audit a finished run from its directory alone (journal, logs, final "
        "state), or, with --state-dir, a job another launcher started (the controller's "
        "state dir and the replicas' stdout files). Prints a table; exits 0 when every "
        "check passes, 1 on any violation, 2 when the input is not a run. "
        "docs/operations.md, 'Auditing a run'.",
        usage="phalanx audit RUN_DIR [--against CALM_RUN_DIR] [--json]\n"
        "       phalanx audit --state-dir DIR LOG [LOG ...] [--final FILE ...] "
        "[--against CALM_RUN_DIR] [--json]",
    )
    a.add_argument(
        "paths",
        nargs="+",
        metavar="RUN_DIR | LOG",
        help="the run directory (runs/JOB-TIME, or phalanx run's --run-dir); with "
        "--state-dir, each replica's stdout file instead (its replica is the one its JSON "
        "lines name; give a replica's restarts after its first run)",
    )
    a.add_argument(
        "--state-dir",
        metavar="DIR",
        help="a job not started by phalanx run: the served controller's --state-dir "
        "(config.json, journal.sqlite)",
    )
    a.add_argument(
        "--final",
        metavar="FILE",
        action="append",
        default=[],
        help="with --state-dir: a replica's final state (--out); repeat for each",
    )
    a.add_argument(
        "--against",
        metavar="CALM_RUN_DIR",
        help="a calm run of the same job: its committed global batches must be equal, and "
        "its final state bit-identical or within the documented tolerance",
    )
    a.add_argument("--json", action="store_true", help="print the result as one JSON line")
    a.set_defaults(fn=run)


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from phalanx.audit.rundir import load_job

    calm = Path(args.against) if args.against else None
    paths = [Path(p) for p in args.paths]
    if args.state_dir is None:
        if len(paths) > 1 or args.final:
            extra = "--final" if args.final else str(paths[1])
            raise SystemExit(
                f"phalanx audit: {extra} needs --state-dir: give one RUN_DIR, or --state-dir DIR "
                f"and the replicas' outputs."
            )
        return audit(paths[0], calm, args.json)
    state_dir, finals = Path(args.state_dir), [Path(f) for f in args.final]
    return audit(state_dir, calm, args.json, lambda: load_job(state_dir, paths, finals))

"""``phalanx audit RUN_DIR [--against CALM_RUN_DIR] [--json]``: the checks of this
package on a finished run, printed as a table (check, verdict, detail), or as JSON.

Exit status: 0 when no check found a violation, 1 on any violation, 2 when
``RUN_DIR`` (or the calm run) is not a run directory (one line naming what is
missing). ``phalanx run --chaos`` ends with the same audit (:func:`after_chaos`).
"""

from __future__ import annotations

import argparse
import json
import sys
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


def audit(run_dir: Path, calm_dir: Path | None = None, as_json: bool = False) -> int:
    """Audit ``run_dir`` (against ``calm_dir``), print the result; return the exit status."""
    from phalanx.audit.rundir import load_run

    try:
        run = load_run(run_dir)
        calm = load_run(calm_dir) if calm_dir is not None else None
    except NotARun as e:
        print(f"phalanx audit: {e}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    checks = audit_checks(run, calm)
    bad = any(c.verdict == FAIL for c in checks)
    if as_json:
        doc: dict[str, Any] = {
            "event": "audit",
            "run_dir": str(run_dir),
            "against": str(calm_dir) if calm_dir is not None else None,
            "ok": not bad,
            "checks": [c.as_dict() for c in checks],
        }
        print(json.dumps(doc), flush=True)
    else:
        print(f"audit of {run_dir}" + (f" against {calm_dir}" if calm_dir else ""))
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
        "state). Prints a table; exits 0 when every check passes, 1 on any violation, 2 "
        "when the directory is not a run. docs/operations.md, 'Auditing a run'.",
    )
    a.add_argument("run_dir", help="the run directory (runs/JOB-TIME, or phalanx run's --run-dir)")
    a.add_argument(
        "--against",
        metavar="CALM_RUN_DIR",
        help="a calm run of the same job: its committed global batches must be equal, and "
        "its final state bit-identical or within the documented tolerance",
    )
    a.add_argument("--json", action="store_true", help="print the result as one JSON line")
    a.set_defaults(fn=run)


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    calm = Path(args.against) if args.against else None
    return audit(Path(args.run_dir), calm, args.json)

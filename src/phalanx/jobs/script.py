"""A replica that runs your own training loop (``[train] script``).

``phalanx replica`` runs the file as ``python FILE ARGS`` would (``__main__``,
``sys.argv``), after recording this replica's arguments (controller, name, job
config, final file), so that :class:`phalanx.Replica` inside the script attaches to
the job as this replica without being told. ``phalanx run``, the agent and Ray
start it like any replica, and read the JSON lines :class:`phalanx.Replica` prints.
A replica of several ranks is not supported here (``[replica] ranks = 1``).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from phalanx.jobs.base import JobError, ReplicaArgs

_current: ReplicaArgs | None = None


def current() -> ReplicaArgs | None:
    """The arguments of the replica this process runs a script for, if it does."""
    return _current


def run(args: ReplicaArgs) -> int:
    """Run ``train.script`` as this replica. Its exit status is the replica's."""
    global _current
    tc = args.cfg.train
    path = Path(tc.script)
    if not path.is_file():
        raise JobError(
            f"train.script must be a Python file: got {tc.script!r}, which is not a file. "
            "Give the path of your training script (relative to where the replica starts)."
        )
    if args.cfg.replica.ranks > 1:
        raise JobError(
            f"train.script runs one process per replica: got [replica] ranks = "
            f"{args.cfg.replica.ranks}. Set ranks = 1."
        )
    _current = args
    argv = sys.argv
    sys.argv = [str(path), *tc.script_args]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as e:
        code = e.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    finally:
        sys.argv = argv
        _current = None
    return 0

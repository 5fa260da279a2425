"""``phalanx audit RUN_DIR [--against CALM_RUN_DIR]``: a finished run checked for
correctness from what it left behind (the controller's journal, the replicas' logs,
the final states), with no controller running.

- :mod:`.base`: the verdict types and the loaded run (:class:`~.base.Run`);
- :mod:`.rundir`: reading a run directory, or a job another launcher started (the
  controller's state dir and the replicas' outputs: :func:`load_job`), one line when
  it is not one;
- :mod:`.steps`: every step committed once, never backwards, none skipped, and the
  final files of one job identical;
- :mod:`.data`: an FT job's committed global batches are the sampler's (exactly-once
  data, from the seed and the dataset's size alone);
- :mod:`.ledger`: an RL job's ledger balances and nothing was trained twice;
- :mod:`.against`: the committed global batches and the final state against a
  calm run's;
- :mod:`.cli`: the command (a table, or ``--json``; exit 0, 1 or 2).
"""

from phalanx.audit.base import Check, NotARun, Run
from phalanx.audit.cli import audit_checks
from phalanx.audit.rundir import load_job, load_run

__all__ = ["Check", "NotARun", "Run", "audit_checks", "load_job", "load_run"]

"""A training job's figures on the console: the progress line and the summary take
the step lines of every replica, and say which step the validation loss is from."""

from __future__ import annotations

from phalanx.console.summary import latest_val, perf_summary, perf_text
from phalanx.launch.replica import Replica


def step(r: Replica, n: int, **figures: float) -> None:
    r.apply({"event": "step", "step": n, "loss": 1.0, "participants": 2, **figures})


def test_the_validation_loss_is_the_latest_any_replica_computed_with_its_step():
    lead, rank0 = Replica("policy-0"), Replica("policy-1")
    step(rank0, 25, tokens_per_s=900.0, peak_mem_mb=1000.0, val_loss=6.44)
    step(lead, 25, tokens_per_s=1000.0, peak_mem_mb=1100.0)
    step(lead, 50, tokens_per_s=1100.0, peak_mem_mb=1050.0)
    # The leader's step-50 line came before rank 0's validation of step 50.
    assert latest_val([lead, rank0]) == (6.44, 25)
    assert (
        perf_text(lead, latest_val([lead, rank0])) == "  1100 tok/s  peak 1100 MB  val 6.4400 @25"
    )
    step(rank0, 50, tokens_per_s=950.0, val_loss=6.18)
    step(lead, 51, tokens_per_s=1000.0)  # no validation on this line: the last stays
    assert latest_val([lead, rank0]) == (6.18, 50)
    assert perf_text(rank0) == "  950 tok/s  peak 1000 MB  val 6.1800 @50"
    got = perf_summary([lead, rank0], lead)
    assert got == {"tokens_per_s": 1000.0, "mfu": None, "peak_mem_mb": 1100.0, "val_loss": 6.18}


def test_a_built_in_task_has_no_figures():
    r = Replica("policy-0")
    step(r, 1)
    assert perf_text(r) == "" and perf_summary([r], r) == {} and latest_val([r]) is None

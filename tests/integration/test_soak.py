"""The soak (issue 40): the FT job (``examples/ft_mlp.toml``) under ``phalanx run
--chaos all-every=S``, a fault every S seconds on average with its kind drawn among
every kind the job takes (kill, stop, controller-kill, slow; partition as root), then ``phalanx audit
--against`` a calm run of as many steps: every step committed once and never
backwards, the same global batches (sample ids) step for step, and the final state
within the documented tolerance.

The soak lasts about ``PHALANX_SOAK_S`` seconds (default 1800, marked ``slow``; a
fault every 15 s): its step count is what a short calm run commits in that time. The
default run has a short soak (``SHORT_S`` seconds, a fault every ``SHORT_EVERY_S``)
that asserts the same. The runs are ``bench/ops_soak.py``'s, so that the bench and
this test soak the same job.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from procs import PROGRESS_S, child_env

from phalanx.launch.chaos import partition

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("ops_soak", ROOT / "bench" / "ops_soak.py")
assert _spec is not None and _spec.loader is not None
ops_soak = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ops_soak)

SOAK_S_ENV = "PHALANX_SOAK_S"
"""The slow soak's length in seconds (default 1800: issue 40's 30 minutes)."""
SHORT_S, SHORT_EVERY_S = 30.0, 4.0
PROBE_STEPS = 40
FT_KINDS = {"kill", "stop", "controller-kill", "slow"} | (
    set() if partition.unavailable() is not None else {"partition"}
)
"""The kinds ``all-every`` draws on the FT job here (``partition`` as root with nftables)."""


def soak(
    tmp_path: Path, soak_s: float, every: float, seed: int, more: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """A probe run for the calm rate, the soak of about ``soak_s`` seconds, a calm run
    of as many steps, and the audit against it (``more``: overrides of all three);
    returns the faults delivered."""
    probe = ops_soak.run_ft(tmp_path / "probe", PROBE_STEPS, None, more)
    assert probe["returncode"] == 0, probe["tail"]
    n, secs = ops_soak.window(tmp_path / "probe")
    steps = max(PROBE_STEPS, round(n / secs * soak_s))
    chaos = ops_soak.run_ft(tmp_path / "chaos", steps, f"all-every={every:g},seed={seed}", more)
    assert chaos["returncode"] == 0, chaos["tail"]
    assert chaos["summary"]["ok"] and chaos["summary"]["steps"] == steps, chaos["summary"]
    assert chaos["audit"]["ok"], chaos["audit"]  # the audit that ends a --chaos run
    calm = ops_soak.run_ft(tmp_path / "calm", steps, None, more)
    assert calm["returncode"] == 0, calm["tail"]
    args = [sys.executable, "-m", "phalanx.cli", "audit", str(tmp_path / "chaos")]
    args += ["--against", str(tmp_path / "calm"), "--json"]
    r = subprocess.run(args, capture_output=True, text=True, env=child_env(), timeout=PROGRESS_S)
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["ok"], doc
    verdicts = {c["check"]: c["verdict"] for c in doc["checks"]}
    want = ("steps.once", "steps.order", "steps.complete", "data.samples", "final.same")
    want += ("against.batches",)
    assert all(verdicts[k] == "pass" for k in (*want, "against.final")), verdicts
    lines = (tmp_path / "chaos" / "chaos.jsonl").read_text().splitlines()
    faults = [json.loads(x) for x in lines]
    # Sample ids compared step for step; a replica SIGKILLed between its commit and its
    # line leaves that one step's batch short of a share (not compared): one per kill.
    batches = next(c for c in doc["checks"] if c["check"] == "against.batches")
    compared = int(batches["detail"].split()[0])
    assert compared >= steps - sum(f["kind"] == "kill" for f in faults), (steps, batches)
    return faults


def test_a_short_soak_of_every_kind_passes_the_audit_against_a_calm_run(tmp_path: Path):
    faults = soak(tmp_path, SHORT_S, SHORT_EVERY_S, seed=5)
    kinds = {f["kind"] for f in faults}
    assert len(faults) >= 3 and len(kinds) >= 2 and kinds <= FT_KINDS, faults


def _soak_s() -> float:
    return float(os.environ.get(SOAK_S_ENV, "1800"))


@pytest.mark.slow
@pytest.mark.timeout(int(_soak_s() * 3) + 600)  # the chaos run, then a calm run as long
def test_the_soak_passes_the_audit_against_a_calm_run(tmp_path: Path):
    soak_s = _soak_s()
    # Exact reduction: over tens of thousands of float32 steps under changing membership,
    # the rounding of a different summation order drifts past the audit's tolerance
    # (0.04 after 50,048 steps, against 1e-4); exact reduction sums in a fixed order
    # whoever takes part, so the final state must equal the calm run's bit for bit.
    faults = soak(tmp_path, soak_s, 15.0, seed=1, more=("--train.exact_reduction", "true"))
    if soak_s >= 300:  # long enough to draw every kind (at 15 s: 20 faults or more)
        assert {f["kind"] for f in faults} == FT_KINDS, faults

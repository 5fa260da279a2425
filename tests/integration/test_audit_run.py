"""``phalanx run --chaos`` ends with ``phalanx audit`` of its own run directory, on the
real FT job and the real RL job (the examples, shortened); and ``phalanx audit
--against`` compares a chaos run of the FT job with a calm one. The audit is the
product's (:mod:`phalanx.audit`), not a copy of its checks."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from procs import PROGRESS_S, child_env

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FT = [str(EXAMPLES / "ft_mlp.toml"), "--train.steps", "80"]
CHAOS = "kill-every=2,restart-after=0.5,seed=3"


def phalanx(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**child_env(), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "phalanx.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=PROGRESS_S)


def audit_of(out: str) -> dict:
    """The ``audit`` JSON line that ends a ``phalanx run --chaos --json``."""
    return next(json.loads(x) for x in out.splitlines() if x.startswith('{"event": "audit"'))


def test_ft_chaos_run_ends_with_a_passing_audit_and_matches_a_calm_run(tmp_path):
    chaos, calm = tmp_path / "chaos", tmp_path / "calm"
    r = phalanx("run", *FT, "--plain", "--json", "--run-dir", str(chaos), "--chaos", CHAOS)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = audit_of(r.stdout)
    assert doc["ok"], doc
    verdicts = {c["check"]: c["verdict"] for c in doc["checks"]}
    assert verdicts["steps.once"] == verdicts["steps.complete"] == "pass", doc
    r = phalanx("run", *FT, "--plain", "--run-dir", str(calm))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "audit of" not in r.stdout  # only a chaos run audits itself
    r = phalanx("audit", str(chaos), "--against", str(calm), "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["ok"], doc
    against = {c["check"]: c for c in doc["checks"] if c["check"].startswith("against.")}
    assert against["against.batches"]["verdict"] == "pass", against
    assert against["against.final"]["verdict"] == "pass", against


def test_rl_chaos_run_ends_with_a_passing_audit(tmp_path):
    run = tmp_path / "rl"
    args = [str(EXAMPLES / "sort_grpo.toml"), "--rl.grpo.steps", "10", "--plain", "--json"]
    r = phalanx("run", *args, "--run-dir", str(run), "--chaos", CHAOS)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = audit_of(r.stdout)
    assert doc["ok"], doc
    verdicts = {c["check"]: c["verdict"] for c in doc["checks"]}
    assert verdicts["ledger.balance"] == verdicts["ledger.trained_once"] == "pass", doc
    # The same audit, run again by hand on the finished run, agrees.
    r = phalanx("audit", str(run))
    assert r.returncode == 0 and "ledger.balance" in r.stdout, r.stdout + r.stderr

"""``phalanx run --controllers 3 --journal etcd``: a local etcd and three controllers,
one leading and two standing by. The leader SIGKILLed mid-job, a standby takes over,
the launcher starts the dead one again (as a standby), and the FT job finishes with
every step committed once. Bad options are one line each, before anything starts."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
from procs import start_run, wait_for
from test_controller_supervised import controller_pid

from phalanx.cli import main
from phalanx.client import ControllerError
from phalanx.console.poll import fetch_status

EXAMPLE = Path(__file__).parents[2] / "examples" / "ft_mlp.toml"
STEPS = 120


def step_of(run: Path) -> int:
    """The job's committed step, asked of whichever controller answers (a standby
    names the leader)."""
    urls = ",".join((run / d / "url").read_text().strip() for d in ("controller", "controller-1"))
    try:
        return fetch_status(urls, timeout_s=2.0).role_step("policy") or 0
    except (ControllerError, OSError):
        return -1


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (make install)")
def test_run_with_standbys_survives_its_leader_sigkilled(tmp_path: Path, monkeypatch):
    run = tmp_path / "run"
    args = [str(EXAMPLE), "--plain", "--json"]
    args += ["--run-dir", str(run), "--controllers", "3", "--journal", "etcd"]
    args += ["--replicas", "2", f"--train.steps={STEPS}", "--train.step_delay_s=0.05"]
    p = start_run(args)  # (without $PHALANX_TOKEN: the launcher makes the group's)
    try:
        wait_for(lambda: (run / "controller-2" / "url").exists(), 120, "the third controller")
        monkeypatch.setenv("PHALANX_TOKEN", (run / "controller" / "token").read_text().strip())
        wait_for(lambda: step_of(run) >= 10, 120, "ten steps under the first leader")
        leader = controller_pid(run / "controller")
        assert leader is not None
        os.kill(leader, signal.SIGKILL)
        at = step_of(run)
        wait_for(lambda: step_of(run) >= max(at, 10) + 10, 120, "ten steps under the new leader")
        out, err = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)  # the launcher stops what it started
            p.communicate(timeout=30)
    assert p.returncode == 0, f"{err[-3000:]}\n{out[-3000:]}"
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["ok"] and summary["steps"] == STEPS, summary
    assert summary["controller_restarts"] == 1  # the killed one, started again as a standby
    assert (run / "etcd.log").exists()
    # Every controller wrote the same token (the group's), which the replicas used.
    tokens = {
        (run / d / "token").read_text() for d in ("controller", "controller-1", "controller-2")
    }
    assert len(tokens) == 1


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--controllers", "3"], "--controllers 3 needs the journal in etcd"),
        (["--controllers", "0"], "--controllers must be 1 to 9: got 0"),
        (["--journal", "zookeeper://z:2181"], "--journal must be 'etcd'"),
    ],
)
def test_controllers_without_a_journal_to_share_are_refused_in_one_line(tmp_path, extra, says):
    with pytest.raises(SystemExit) as e:
        main(["run", str(EXAMPLE), "--run-dir", str(tmp_path / "run"), *extra])
    assert str(e.value).startswith(f"phalanx run: {says}") and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed (make install)")
def test_an_rl_job_with_standbys_keeps_its_rollouts_outside_and_survives_its_leader(
    tmp_path: Path, monkeypatch
):
    """``phalanx run`` of the RL example with two controllers: its rollouts go to the
    run dir's store (said in a line), the leader SIGKILLed mid-job, the standby takes
    over, and the job trains every batch with the ledger balanced."""
    from test_dashboard_browser import EXAMPLE as RL_EXAMPLE
    from test_dashboard_browser import SHRINK

    run = tmp_path / "run"
    args = [str(RL_EXAMPLE), "--plain", "--json", "--run-dir", str(run)]
    args += ["--controllers", "2", "--journal", "etcd", *SHRINK, "--rl.grpo.steps", "30"]
    p = start_run(args)
    try:
        wait_for(lambda: (run / "controller-1" / "url").exists(), 120, "the standby")
        monkeypatch.setenv("PHALANX_TOKEN", (run / "controller" / "token").read_text().strip())
        wait_for(lambda: step_of(run) >= 4, 180, "a few batches under the first leader")
        leader = controller_pid(run / "controller")
        assert leader is not None
        os.kill(leader, signal.SIGKILL)
        out, err = p.communicate(timeout=400)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)  # the launcher stops what it started
            p.communicate(timeout=30)
    assert p.returncode == 0, f"{err[-3000:]}\n{out[-3000:]}"
    store = f"file://{(run / 'rollouts').resolve()}"
    assert f"phalanx run: rollouts go to {store}" in err, err[-2000:]
    dashboard = next(x for x in out.splitlines() if "dashboard: " in x)
    assert "," not in dashboard.split("dashboard: ")[1], dashboard  # one page's URL
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["ok"] and summary["ledger_ok"] is True, summary
    assert summary["controller_restarts"] == 1, summary
    assert summary["steps"] == 30 and summary["trained"] > 0, summary
    # Nothing lost with the leader: no rollout's payload went missing.
    assert "payload_missing" not in summary["discarded"], summary["discarded"]

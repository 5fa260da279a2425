"""``phalanx run`` supervises its controller: a controller SIGKILLed while the RL
job runs is started again on its state dir and port, the replicas re-attach,
and the job finishes with its ledger balanced, every prompt trained once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from procs import child_env, wait_for
from test_rl_launch import PROMPTS, rl_job, summary_of

from phalanx.client import ControllerError
from phalanx.console.poll import fetch_status

BATCHES = 30


def controller_pid(state: Path) -> int | None:
    """The pid of the controller that holds the state dir and listens (its lock's note)."""
    try:
        note = (state / "controller.lock").read_text().split()
    except OSError:
        return None
    return int(note[1]) if len(note) >= 4 else None


def batches(state: Path) -> int:
    try:
        st = fetch_status(str(state), timeout_s=2.0)
    except ControllerError:
        return -1  # down (being restarted)
    return st.rl.next_batch if st.rl is not None else 0


def test_run_survives_its_controller_sigkilled_twice(tmp_path: Path):
    config = rl_job(tmp_path / "job.toml", steps=BATCHES, target=None)
    run = tmp_path / "run"
    args = [sys.executable, "-m", "phalanx.cli", "run", str(config), "--plain", "--json"]
    args += ["--run-dir", str(run), "--rl.loop.target_exact_match=null"]
    # Paced generation: the job runs long enough for two kills, whatever the machine.
    args += ["--rl.loop.gen_delay_s", "0.25"]
    p = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
        start_new_session=True,
    )
    state = run / "controller"
    try:
        pids = []
        for kill in range(2):
            # Progress under this controller first: two more batches.
            at = max(batches(state), 0)
            wait_for(lambda at=at: batches(state) >= at + 2, 120, f"batches after kill {kill}")
            pid = controller_pid(state)
            assert pid is not None and pid not in pids
            pids.append(pid)
            os.kill(pid, signal.SIGKILL)
            # The launcher starts another on the same state dir (a new pid in its lock).
            wait_for(lambda: controller_pid(state) not in (None, *pids), 120, "a new controller")
        out, err = p.communicate(timeout=240)
    finally:
        if p.poll() is None:
            p.terminate()
            p.communicate(timeout=30)
    assert p.returncode == 0, f"{err[-3000:]}\n{out[-3000:]}"
    s = summary_of(out)
    assert s["ok"] and s["ledger_ok"] and s["error"] is None, s
    assert s["batches"] == BATCHES and s["trained"] == BATCHES * PROMPTS
    assert s["controller_restarts"] == 2
    assert out.count("controller exited with -9; restarting it on") == 2
    assert "controller back at" in out and "controller restarted 2 time(s)" in out
    # The same port both times: replicas that knew only the URL found it again.
    urls = {line.rsplit(" at ", 1)[1].split()[0] for line in out.splitlines() if "back at" in line}
    assert len(urls) == 1 and (state / "url").read_text().strip() in urls

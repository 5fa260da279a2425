"""The elastic agent (``phalanx agent``) end to end: a real controller, real
agents supervising real workers, real SIGKILLs.

1. SIGKILL the agent's worker (a ``phalanx replica`` of the FT job): the agent
   reports the exit at once (the controller evicts long before the heartbeat
   timeout), restarts the worker, which heals from its peer and rejoins; the
   job ends with both replicas in the same state and every step committed once.
   The agent tracks the job (``--track``): each step logged once, the kill and
   the heal counted.
2. Layout change: an agent runs a tensor-parallel worker on 2 ranks; an
   operator asks for 1 (``phalanx agent resize``); the workers checkpoint on
   SIGTERM, start again with WORLD_SIZE 1, reshard-load the checkpoint and
   finish, with no step skipped or trained twice.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from ftjob import (
    TRAIN,
    FTJob,
    Proc,
    assert_identical,
    audit_outputs,
    load_state,
    write_job,
)
from procs import PROGRESS_S, Controller, wait_for

from phalanx.launch.agent.files import request_resize
from phalanx.launch.agent.options import LATEST_POINTER, latest_step
from phalanx.testing.track import tensorboard_scalars
from phalanx.train.snapshot import load_state as load_snapshot

STEPS = 30
KILL_AT = 8
BATCH = TRAIN["global_batch_size"]
HEARTBEAT_S = 10.0


def agent_cmd(controller: Path | None, name: str, run_dir: Path, *opts: str) -> list[str]:
    args = [sys.executable, "-m", "phalanx.cli", "agent", "--name", name, "--run-dir", str(run_dir)]
    if controller is not None:
        args += ["--controller", str(controller)]
    return [*args, "--node", "test-node", *opts]


def worker_lines(run_dir: Path, gen: int, rank: int = 0) -> list[dict[str, Any]]:
    """JSON lines a worker of generation ``gen`` printed (complete lines only)."""
    path = run_dir / f"gen{gen}" / f"rank{rank}.out"
    lines = path.read_text().split("\n")[:-1] if path.exists() else []
    return [json.loads(x) for x in lines if x.startswith("{")]


def stop_agent(agent: Proc, run_dir: Path) -> None:
    """Stop an agent that may still run: SIGTERM (it stops its workers), then
    SIGKILL its group and the last workers it recorded, by pid."""
    if agent.popen.poll() is None:
        agent.signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            agent.popen.wait(timeout=15)
    if agent.popen.poll() is None:
        agent.kill()
        with contextlib.suppress(OSError, ValueError):
            for w in json.loads((run_dir / "workers.json").read_text())["workers"]:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(w["pid"], signal.SIGKILL)


@pytest.fixture
def ft_job(tmp_path: Path) -> Iterator[FTJob]:
    """An FT job whose second replica is required (``min_replicas 2``: the survivor
    waits for the restarted one, so the heal happens however slow the restart),
    with slow passive detectors: a 10 s heartbeat timeout, a 5 s suspect grace
    and no suspicion on a dropped connection. Only the agent is fast."""
    job = FTJob(
        tmp_path,
        write_job(
            tmp_path / "job.toml",
            job_id="agent-kill",
            train={"steps": STEPS, "step_delay_s": 0.03},
            policy={"n_init_replicas": 2, "min_replicas": 2},
            timeouts={
                "heartbeat_s": HEARTBEAT_S,
                "suspect_grace_s": 5.0,
                "suspect_on_disconnect": False,
                "probe_address": False,  # b's report must not evict a before its agent does
            },
        ),
    )
    try:
        yield job
    finally:
        job.cleanup(exit_grace_s=15.0)


def test_sigkill_worker_is_reported_restarted_and_heals(ft_job: FTJob, tmp_path: Path):
    job = ft_job
    job.start_controller()
    b = job.start_replica("b")
    run_dir = tmp_path / "agent-a"
    out = tmp_path / "a.safetensors"
    worker = ["--", sys.executable, "-m", "phalanx.cli", "replica", "--config", str(job.config)]
    worker += ["--controller", "{controller}", "--name", "{name}", "--out", str(out)]
    args = agent_cmd(job.state_dir, "a", run_dir, "--backoff-s", "0.2", "--max-restarts", "2")
    args += ["--track", "--config", str(job.config)]  # this agent logs the job's metrics
    agent = Proc([*args, *worker], "agent-a", tmp_path)
    try:
        started = agent.wait_event(lambda e: e["event"] == "start", "the workers' start")
        victim = started["workers"][0]["pid"]
        # Killed just after it printed a step: between two steps' commits, so that
        # every step it committed is in its output.
        wait_for(
            lambda: any(e.get("step", 0) >= KILL_AT for e in worker_lines(run_dir, 0)),
            PROGRESS_S,
            f"the agent's worker to commit step {KILL_AT}",
        )
        os.kill(victim, signal.SIGKILL)
        killed_at = time.time()

        exit_ev = agent.wait_event(lambda e: e["event"] == "worker_exit", "the worker's exit")
        assert exit_ev["pid"] == victim and exit_ev["code"] == -signal.SIGKILL, exit_ev
        reported = agent.wait_event(lambda e: e["event"] == "reported", "the report")
        assert "error" not in reported and len(reported["replica_ids"]) == 1, reported
        old_id = reported["replica_ids"][0]
        assert old_id.startswith("a:")
        evicted = [
            e for e in job.status()["events"] if e["kind"] == "evict" and e["replica_id"] == old_id
        ]
        assert len(evicted) == 1, evicted
        assert "reported by agent test-node" in evicted[0]["reason"], evicted
        assert "signal 9" in evicted[0]["reason"], evicted
        # Detected by the agent, not by the heartbeat timeout or a peer's report.
        assert evicted[0]["at"] - killed_at < 2.0, (evicted[0], killed_at)

        restart = agent.wait_event(lambda e: e["event"] == "restart", "the restart")
        assert restart["restart"] == 1 and restart["delay_s"] == pytest.approx(0.2), restart
        again = agent.wait_event(
            lambda e: e["event"] == "start" and e["generation"] == 1, "the second start"
        )
        assert again["reason"] == "failure" and again["workers"][0]["pid"] != victim

        final_b = b.finish()
        agent.wait_event(lambda e: e["event"] == "done", "the agent's done", timeout=90)
        assert agent.popen.wait(timeout=30) == 0, agent.stderr_tail()
    finally:
        stop_agent(agent, run_dir)

    before, after = worker_lines(run_dir, 0), worker_lines(run_dir, 1)
    before_steps = [e for e in before if e["event"] == "step"]
    after_steps = [e for e in after if e["event"] == "step"]
    assert before_steps and before_steps[-1]["step"] >= KILL_AT - 1
    # The restarted worker is a new incarnation that healed from b on its first step.
    first = after_steps[0]
    assert first["replica"] != old_id and first["replica"].startswith("a:"), first
    assert first["healed"] is True and first["participants"] == 2, first
    assert first["step"] == before_steps[-1]["step"] + 1, (before_steps[-1], first)
    assert after[-1]["event"] == "done" and after[-1]["step"] == STEPS, after[-1]
    # Every step committed once by both replicas, on exactly-once data...
    workers = [run_dir / f"gen{g}" / "rank0.out" for g in (0, 1)]
    audit_outputs(job.state_dir, [b.out_path, *workers], STEPS)
    # ... and both end bit-identical.
    assert_identical([final_b, load_state(out)])
    # The tracking agent logged each step once (its replica took part in every one,
    # min_replicas being 2), the kill and the heal as they came.
    got = tensorboard_scalars(run_dir / "tb")
    assert [s for s, _ in got["train/loss"]] == list(range(1, STEPS + 1))
    b_loss = {e["step"]: e["loss"] for e in b.steps()}  # (TensorBoard keeps float32)
    assert [v for _, v in got["train/loss"]] == pytest.approx([b_loss[s] for s in b_loss])
    assert got["job/kills"][-1] == (STEPS, 1.0) and got["job/heals"][-1] == (STEPS, 1.0)


# -- 2: layout change, 2 workers -> 1 -----------------------------------------------

TP_STEPS = 20
SAVE_EVERY = 5


@pytest.mark.parametrize(
    "compare", [False, pytest.param(True, marks=pytest.mark.slow, id="vs-uninterrupted")]
)
def test_layout_change_from_two_workers_to_one_resumes(
    tmp_path: Path, start_controller: Callable[..., Controller], compare: bool
):
    """A tensor-parallel replica (``phalanx.jobs.tp_worker``, TP = WORLD_SIZE) on
    2 workers; the operator asks for 1. The flow: 1. SIGTERM, the workers
    checkpoint the step they stopped at; 2. restart with WORLD_SIZE 1; 3. the
    worker reshard-loads that checkpoint; 4. it registers again (rejoin) and
    finishes. Every step is trained once. With ``compare`` (slow: one more
    process on a small machine), the losses and final state also equal those
    of an uninterrupted 1-worker run (up to float reduction order); the
    reshard tests check that identity for the worker alone."""
    ctl = start_controller()
    run_dir = tmp_path / "agent-tp"
    tp_worker = [sys.executable, "-m", "phalanx.jobs.tp_worker", "--steps", str(TP_STEPS)]
    # Paced so that the resize surely lands before the last step, however loaded the machine.
    tp_worker += ["--save-every", str(SAVE_EVERY), "--step-delay", "0.25"]
    worker = [*tp_worker, "--ckpt", "{ckpt}", "--controller", "{controller}", "--name", "{name}"]
    worker += ["--out", str(tmp_path / "resized.st")]
    args = agent_cmd(
        ctl.state_dir, "tp", run_dir, "--nproc", "2", "--ckpt", f"file://{tmp_path}/ck"
    )
    agent = Proc([*args, "--", *worker], "agent-tp", tmp_path)
    reference = None
    if compare:
        ref_args = ["--ckpt", f"file://{tmp_path}/ref", "--out", str(tmp_path / "ref.st")]
        reference = Proc([*tp_worker, *ref_args], "reference", tmp_path)
    try:
        started = agent.wait_event(lambda e: e["event"] == "start", "the workers' start")
        assert started["nproc"] == 2 and len(started["workers"]) == 2
        wait_for(
            lambda: any(e.get("step", 0) >= SAVE_EVERY + 1 for e in worker_lines(run_dir, 0)),
            PROGRESS_S,
            f"the 2-worker replica to reach step {SAVE_EVERY + 1}",
        )
        # What `phalanx agent resize --nproc 1` does (without its interpreter's start-up).
        assert request_resize(run_dir, 1) == agent.popen.pid
        agent.wait_event(lambda e: e["event"] == "done", "the agent's done", timeout=90)
        assert agent.popen.wait(timeout=30) == 0, agent.stderr_tail()
        if reference is not None:
            assert reference.popen.wait(timeout=90) == 0, reference.stderr_tail()
            reference._reader.join(timeout=10)
    finally:
        stop_agent(agent, run_dir)
        if reference is not None and reference.popen.poll() is None:
            reference.kill()

    # 1. The workers stopped on SIGTERM and checkpointed the step they stopped at.
    before, after = worker_lines(run_dir, 0), worker_lines(run_dir, 1)
    stop = before[-1]
    assert stop["event"] == "done" and stop["reason"] == "sigterm" and stop["world"] == 2, stop
    (layout,) = events(agent, "layout")
    assert (layout["from"], layout["to"], layout["reason"]) == (2, 1, "operator request")
    assert [w["code"] for w in layout["stopped"]] == [0, 0], layout  # none needed SIGKILL
    assert layout["latest_step"] == stop["checkpoint"] == stop["step"], (layout, stop)
    # 2. They started again with WORLD_SIZE 1 (a layout change is not a failure restart)...
    starts = events(agent, "start")
    assert [(e["nproc"], e["reason"]) for e in starts] == [(2, "initial"), (1, "layout")]
    assert not events(agent, "restart") and not events(agent, "worker_exit")
    # 3. ... reshard-loaded the checkpoint and went on from the next step: no step
    # skipped or trained twice.
    assert all(e["world"] == 1 and e["resumed_from"] == stop["step"] for e in after), after[0]
    steps = [e["step"] for e in [*before, *after] if e["event"] == "step"]
    assert steps == list(range(1, TP_STEPS + 1)), steps
    assert after[-1]["event"] == "done" and after[-1]["reason"] == "finished", after[-1]
    assert load_snapshot(tmp_path / "resized.st")["step"] == TP_STEPS
    if reference is not None:
        ref = {e["step"]: e["loss"] for e in reference.events if e["event"] == "step"}
        for e in [*before, *after]:
            if e["event"] == "step":
                assert math.isclose(e["loss"], ref[e["step"]], rel_tol=1e-9), (e, ref[e["step"]])
        got, want = load_snapshot(tmp_path / "resized.st"), load_snapshot(tmp_path / "ref.st")
        for key, t in want["model"].items():
            torch.testing.assert_close(got["model"][key], t, rtol=1e-8, atol=1e-10, msg=key)
    # 4. It rejoined: a second incarnation of the replica registered after the first left.
    ids = [e["replica_id"] for e in before + after if e["event"] == "done"]
    assert len(set(ids)) == 2 and all(i.startswith("tp:") for i in ids), ids
    kinds = [
        (e["kind"], e["replica_id"]) for e in ctl.status()["events"] if e.get("replica_id") in ids
    ]
    assert kinds == [("join", ids[0]), ("evict", ids[0]), ("join", ids[1]), ("evict", ids[1])], (
        kinds
    )


# -- the agent's own logic, with tiny workers (seconds) ------------------------------


def run_agent(tmp_path: Path, label: str, *opts: str, code: str) -> tuple[Proc, Path]:
    run_dir = tmp_path / label
    args = agent_cmd(None, label, run_dir, *opts, "--", sys.executable, "-c", code)
    return Proc(args, label, tmp_path), run_dir


def events(agent: Proc, kind: str | None = None) -> list[dict[str, Any]]:
    with agent._cond:
        return [e for e in agent.events if kind is None or e["event"] == kind]


def finished(agent: Proc, run_dir: Path, timeout: float = 60) -> int:
    try:
        rc = agent.popen.wait(timeout=timeout)
        agent._reader.join(timeout=10)
        return rc
    finally:
        stop_agent(agent, run_dir)


def test_a_slot_that_keeps_failing_is_dropped(tmp_path: Path):
    """Slot 1's worker fails first twice in a row: the slot counts as lost and the
    replica goes on with one worker (--min-nproc 1), which then finishes."""
    code = "import os, sys; sys.exit(3 if os.environ['PHALANX_SLOT'] == '1' else 0)"
    agent, run_dir = run_agent(
        tmp_path, "lost", "--nproc", "2", "--min-nproc", "1", "--backoff-s", "0", code=code
    )
    assert finished(agent, run_dir) == 0, agent.stderr_tail()
    assert [(e["generation"], e["nproc"]) for e in events(agent, "start")] == [
        (0, 2),
        (1, 2),
        (2, 1),
    ]
    assert [e["slot"] for e in events(agent, "worker_exit")] == [1, 1]
    (layout,) = events(agent, "layout")
    assert (layout["from"], layout["to"], layout["slots"]) == (2, 1, [0]), layout
    assert "slot 1 lost" in layout["reason"]
    assert events(agent)[-1]["event"] == "done"


def test_restarts_are_bounded(tmp_path: Path):
    agent, run_dir = run_agent(
        tmp_path, "broken", "--max-restarts", "2", "--backoff-s", "0.05", code="exit(3)"
    )
    assert finished(agent, run_dir) == 1
    assert [e["delay_s"] for e in events(agent, "restart")] == [0.05, 0.1]
    (failed,) = events(agent, "failed")
    assert "exited with code 3" in failed["error"] and "--max-restarts 2" in failed["error"]
    assert "giving up" in agent.stderr_tail()


def test_a_worker_that_cannot_run_is_not_restarted(tmp_path: Path):
    """Exit 78 (a replica with no usable checkpoint, or a config it cannot run): the
    agent says the worker's one line once and stops, instead of a crash loop that
    ended in "exited 3 times in a row without progress" (issue 20)."""
    line = "phalanx replica x: no usable checkpoint under file:///ck: step 3: bad"
    code = f"import sys; print({line!r}, file=sys.stderr); sys.exit(78)"
    agent, run_dir = run_agent(tmp_path, "nockpt", "--max-restarts", "5", code=code)
    assert finished(agent, run_dir) == 1
    assert not events(agent, "restart")
    (failed,) = events(agent, "failed")
    assert failed["error"] == f"replica nockpt: worker rank 0 cannot run: {line}"


def test_sigterm_stops_the_workers(tmp_path: Path):
    agent, run_dir = run_agent(
        tmp_path, "stop", "--nproc", "2", code="import time; time.sleep(120)"
    )
    pids = [w["pid"] for w in agent.wait_event(lambda e: e["event"] == "start", "start")["workers"]]
    agent.signal(signal.SIGTERM)
    assert finished(agent, run_dir) == 128 + signal.SIGTERM
    (stopped,) = events(agent, "stopped")
    assert stopped["signal"] == "SIGTERM"
    assert sorted(w["pid"] for w in stopped["workers"]) == sorted(pids)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert not (run_dir / "agent.pid").exists()


def test_resize_restarts_with_the_new_world_size(tmp_path: Path):
    code = (
        "import os, signal, sys, time; "
        "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
        "print(os.environ['RANK'], os.environ['WORLD_SIZE'], flush=True); "
        "time.sleep(120 if os.environ['PHALANX_RESTART_COUNT'] == '0' else 0)"
    )
    agent, run_dir = run_agent(tmp_path, "resize", "--nproc", "2", code=code)
    agent.wait_event(lambda e: e["event"] == "start", "start")
    resize = [sys.executable, "-m", "phalanx.cli", "agent", "resize", "--run-dir", str(run_dir)]
    for n in (2, 1):  # the same layout first: nothing happens
        done = subprocess.run(
            [*resize, "--nproc", str(n)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert f"took the request: {n} worker(s)" in done.stdout
    assert finished(agent, run_dir) == 0, agent.stderr_tail()
    (ignored,) = events(agent, "resize_ignored")
    assert ignored["nproc"] == 2
    (layout,) = events(agent, "layout")
    assert (layout["from"], layout["to"], layout["reason"]) == (2, 1, "operator request")
    assert [w["code"] for w in layout["stopped"]] == [0, 0]  # they exited on SIGTERM
    assert [e["nproc"] for e in events(agent, "start")] == [2, 1]
    assert (run_dir / "gen1" / "rank0.out").read_text() == "0 1\n"
    assert not events(agent, "restart")  # a layout change asked for is not a failure


def test_latest_step_reads_the_checkpoint_stores_pointer(tmp_path: Path):
    """The agent reads ``latest`` without importing torch; it must agree with the
    checkpoint store that writes it."""
    from phalanx.checkpoint import Checkpointer, CheckpointStore
    from phalanx.checkpoint.base import LATEST

    assert LATEST == LATEST_POINTER
    url = f"file://{tmp_path}/ck"
    assert latest_step(url) is None
    ck = Checkpointer(url)
    try:
        for step in (3, 7):
            ck.save(step, {"w": torch.full((2,), float(step)), "step": step})
    finally:
        ck.close()
    assert latest_step(url) == CheckpointStore(url).latest() == 7


def test_agent_serves_the_controller_and_starts_it_again_when_it_dies(
    ft_job: FTJob, tmp_path: Path
):
    """``phalanx agent --serve-controller`` runs the job's controller on its state
    dir: SIGKILLed, the controller is started again on the same dir and port,
    with its journal (the epoch goes up, the members are still there)."""
    job = ft_job
    run_dir = tmp_path / "agent-ctl"
    args = [sys.executable, "-m", "phalanx.cli", "agent", "--serve-controller"]
    args += ["--controller", str(job.state_dir), "--config", str(job.config)]
    args += ["--run-dir", str(run_dir)]
    agent = Proc(args, "agent-ctl", tmp_path)
    try:
        first = agent.wait_event(lambda e: e["event"] == "controller", "the controller")
        url = first["url"]
        auth = {"Authorization": f"Bearer {(job.state_dir / 'token').read_text().strip()}"}

        def status() -> dict[str, Any]:
            return httpx.get(f"{url}/v1/status", headers=auth, timeout=10).json()

        reg = {"role": "policy", "name": "m0"}
        rid = httpx.post(f"{url}/v1/register", json=reg, headers=auth, timeout=10).json()
        assert status()["epoch"] == 1
        os.kill(first["pid"], signal.SIGKILL)
        again = agent.wait_event(
            lambda e: e["event"] == "controller_restart" and "back at" in e["note"],
            "the controller to be back",
        )
        assert again["restarts"] == 1 and again["pid"] != first["pid"]
        assert f"back at {url}" in again["note"]  # the same port
        st = status()
        members = [m["replica_id"] for m in st["roles"]["policy"]["replicas"]]
        assert st["epoch"] == 2 and rid["replica_id"] in members
        agent.signal(signal.SIGTERM)
        assert agent.popen.wait(timeout=30) == 128 + signal.SIGTERM
        agent.wait_event(lambda e: e["event"] == "stopped", "the agent's stop")
        with pytest.raises(ProcessLookupError):  # the controller went with it
            wait_for(lambda: os.kill(again["pid"], 0), 10, "the controller to exit", 0.1)
    finally:
        stop_agent(agent, run_dir)

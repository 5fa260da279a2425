"""The launcher's zygote (``phalanx.launch.zygote``): a real process that preloads
modules and forks real ``phalanx`` commands, which the tests signal by process
group and whose exit codes come back over its socket.

One zygote serves the module (its preload is the slow part); the test that
kills it makes its own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import wait_for

from phalanx.launch.forks import UNKNOWN_EXIT, Zygote

SORT = Path(__file__).parents[2] / "examples" / "sort_grpo.toml"


@pytest.fixture(scope="module")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Zygote]:
    z = Zygote(["phalanx.config", "no_such_module_xyz"], tmp_path_factory.mktemp("z") / "z.log")
    try:
        assert z.ready(120), "the zygote did not come up"
        yield z
    finally:
        z.close()


def test_a_forked_command_runs_with_its_output_and_exit_code(zygote: Zygote, tmp_path: Path):
    assert zygote.failed == ["no_such_module_xyz"]  # a failed preload is said, not fatal
    log = tmp_path / "help.log"
    proc = zygote.spawn(["run", "--help"], log, pipe_stdout=True)
    assert proc is not None and proc.stdout is not None
    out = proc.stdout.read().decode()
    assert proc.wait(60) == 0 and "--no-zygote" in out
    # Bad input: the child's one-line error lands in its log, with the command's code.
    bad = zygote.spawn(["replica", "--config", str(tmp_path / "none.toml")], log, False)
    assert bad is not None and bad.wait(60) == 2
    assert "none.toml" in log.read_text().strip().splitlines()[-1]


def test_a_forked_child_has_its_own_session_env_and_cwd(
    zygote: Zygote, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.chdir(tmp_path)
    state = tmp_path / "ctl"
    argv = ["controller", "--config", str(SORT), "--state-dir", "ctl", "--port", "0"]
    proc = zygote.spawn(argv, tmp_path / "ctl.log", pipe_stdout=False)
    assert proc is not None
    try:
        # A relative --state-dir: the launcher's working directory is the child's.
        wait_for(lambda: (state / "url").exists(), 60, "the forked controller to listen")
        assert os.getpgid(proc.pid) == proc.pid  # a session of its own: signalled by group
        # The launcher's environment of now, not the zygote's of its start.
        monkeypatch.setenv("PHALANX_CONTROLLER", str(state))
        st = zygote.spawn(["status", "--json"], tmp_path / "st.log", pipe_stdout=True)
        assert st is not None and st.stdout is not None
        assert json.loads(st.stdout.read())["job_id"] == "sort-grpo"
        assert st.wait(60) == 0
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
    assert proc.wait(60) == -signal.SIGKILL  # as Popen gives it


RANK = """
import os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(t)
os.write(1, f"rank {dist.get_rank()} sum {t.item():.0f}\\n".encode())  # one write: no interleaving
time.sleep(120)
"""


def test_a_replicas_ranks_are_forked_and_fail_together(zygote: Zygote, tmp_path: Path):
    """The zygote forks a replica's ranks launcher, which forks its ranks (imports
    done, as ``phalanx run`` starts replicas of several ranks): they rendezvous at
    the launcher's store, carry their rank in their name, stay in the launcher's
    process group, and a rank's SIGKILL stops the other and the launcher."""
    import sys

    from phalanx.launch.ranks import rank_pids

    log = tmp_path / "ranks.log"
    argv = ["--fork", "--nproc", "2", "--", sys.executable, "-c", RANK]
    proc = zygote.spawn(argv, log, pipe_stdout=True, module="phalanx.launch.ranks")
    assert proc is not None and proc.stdout is not None
    try:
        lines = sorted(proc.stdout.readline().decode().strip() for _ in range(2))
        assert lines == ["rank 0 sum 3", "rank 1 sum 3"], log.read_text()[-2000:]
        ranks = rank_pids(proc.pid)
        assert sorted(ranks) == [0, 1]
        for r, pid in ranks.items():
            assert Path(f"/proc/{pid}/comm").read_text().strip() == f"phalanx-rank{r}"
            assert os.getpgid(pid) == proc.pid
        os.kill(ranks[1], signal.SIGKILL)
        assert proc.wait(60) == 128 + signal.SIGKILL  # the replica's exit is its rank's
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher's group: its ranks too
    assert "rank 1 exited with status 137" in log.read_text()
    wait_for(lambda: not Path(f"/proc/{ranks[0]}").exists(), 30, "rank 0 to be reaped")


def test_a_dead_zygote_reports_unknown_exits_and_forks_no_more(tmp_path: Path):
    z = Zygote([], tmp_path / "z.log")
    try:
        assert z.ready(60)
        state = tmp_path / "ctl"
        argv = ["controller", "--config", str(SORT), "--state-dir", str(state), "--port", "0"]
        proc = z.spawn(argv, tmp_path / "ctl.log", pipe_stdout=False)
        assert proc is not None
        os.killpg(z.proc.pid, signal.SIGKILL)
        wait_for(lambda: z.dead, 30, "the launcher to see the zygote gone")
        assert proc.poll() is None  # its child lives on, in its own session
        assert z.spawn(["--help"], tmp_path / "x.log", pipe_stdout=True) is None
        os.killpg(proc.pid, signal.SIGKILL)
        assert proc.wait(60) == UNKNOWN_EXIT
    finally:
        z.close()

"""``phalanx.launch.ranks``: a replica's ranks start with torchrun's environment
and fail together. Real processes; the ranks here are small Python programs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

RANK_ENV = (
    "import json, os; os.write(1, (json.dumps({k: os.environ[k] for k in "
    "('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')}) + '\\n').encode())"
)
"""Each rank's line in one write: ranks started together print at once (``print``
writes the text and its newline apart when the output is unbuffered)."""


FORK = pytest.mark.parametrize("fork", [False, True], ids=["started", "forked"])
"""Each case with ranks started as fresh interpreters, and forked (``--fork``)."""


def launch(
    nproc: int, code: str, tmp_path: Path, fork: bool = False
) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "phalanx.launch.ranks", "--nproc", str(nproc)]
    cmd += ["--fork", "--"] if fork else ["--"]
    return subprocess.run(
        [*cmd, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,  # a bound on a loaded machine: each run takes moments
        cwd=tmp_path,
    )


@FORK
def test_each_rank_gets_torchruns_environment_and_one_store(tmp_path: Path, fork: bool) -> None:
    p = launch(3, RANK_ENV, tmp_path, fork)
    assert p.returncode == 0, p.stderr
    envs = [json.loads(line) for line in p.stdout.splitlines()]
    assert sorted(e["RANK"] for e in envs) == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert all(e["LOCAL_RANK"] == e["RANK"] for e in envs)
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1


@FORK
def test_a_failing_rank_stops_the_others_and_the_launcher_exits_with_its_status(
    tmp_path: Path, fork: bool
) -> None:
    # Rank 1 fails at once; rank 0 would sleep for a minute, and writes its pid first.
    code = (
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    sys.exit(7)\n"
        "open('rank0.pid', 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    p = launch(2, code, tmp_path, fork)
    assert p.returncode == 7
    assert "rank 1 exited with status 7; stopping the replica's other ranks" in p.stderr
    pid = int((tmp_path / "rank0.pid").read_text()) if (tmp_path / "rank0.pid").exists() else 0
    if pid:  # it had started: it is gone now (killed, and reaped by the launcher)
        assert (
            not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
        )


@FORK
def test_a_rank_killed_by_a_signal_is_reported_as_a_shell_would(tmp_path: Path, fork: bool) -> None:
    code = "import os, signal, time\nif os.environ['RANK'] == '0':\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(60)\n"
    p = launch(2, code, tmp_path, fork)
    assert p.returncode == 128 + 9, p.stderr


def test_without_a_command_it_says_what_to_give(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "phalanx.launch.ranks", "--nproc", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )
    assert p.returncode == 2 and "a command must follow '--'" in p.stderr


def test_fork_refuses_a_command_it_cannot_run_in_a_fork(tmp_path: Path) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "phalanx.launch.ranks", "--nproc", "2", "--fork", "--", "ls"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert "--fork runs a command of this Python" in p.stderr and "drop --fork" in p.stderr


def test_a_host_whose_node_0_store_never_answers_says_so_in_one_line(tmp_path: Path) -> None:
    from phalanx.net import free_port

    cmd = [sys.executable, "-m", "phalanx.launch.ranks", "--nproc", "1", "--nnodes", "2"]
    cmd += ["--node-rank", "1", "--master-addr", f"127.0.0.1:{free_port()}"]
    cmd += ["--rdzv-timeout-s", "0.3", "--", sys.executable, "-c", "pass"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 1
    assert "the replica's node rank 0 must serve its store at 127.0.0.1:" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    bad = subprocess.run(
        [*cmd[:7], "--node-rank", "2", "--master-addr", "127.0.0.1", "--", "true"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )  # fmt: skip
    assert bad.returncode == 2 and "--node-rank must be in [0, --nnodes)" in bad.stderr

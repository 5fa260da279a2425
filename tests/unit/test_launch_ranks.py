"""``phalanx.launch.ranks``: a replica's ranks start with torchrun's environment
and fail together. Real processes; the ranks here are small Python programs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

RANK_ENV = (
    "import json, os; print(json.dumps({k: os.environ[k] for k in "
    "('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')}), flush=True)"
)


def launch(nproc: int, code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "phalanx.launch.ranks", "--nproc", str(nproc), "--"]
    return subprocess.run(
        [*cmd, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,  # a bound on a loaded machine: each run takes moments
        cwd=tmp_path,
    )


def test_each_rank_gets_torchruns_environment_and_one_store(tmp_path: Path) -> None:
    p = launch(3, RANK_ENV, tmp_path)
    assert p.returncode == 0, p.stderr
    envs = [json.loads(line) for line in p.stdout.splitlines()]
    assert sorted(e["RANK"] for e in envs) == ["0", "1", "2"]
    assert {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert all(e["LOCAL_RANK"] == e["RANK"] for e in envs)
    assert len({(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs}) == 1


def test_a_failing_rank_stops_the_others_and_the_launcher_exits_with_its_status(
    tmp_path: Path,
) -> None:
    # Rank 1 fails at once; rank 0 would sleep for a minute, and writes its pid first.
    code = (
        "import os, sys, time\n"
        "if os.environ['RANK'] == '1':\n"
        "    sys.exit(7)\n"
        "open('rank0.pid', 'w').write(str(os.getpid()))\n"
        "time.sleep(60)\n"
    )
    p = launch(2, code, tmp_path)
    assert p.returncode == 7
    assert "rank 1 exited with status 7; stopping the replica's other ranks" in p.stderr
    pid = int((tmp_path / "rank0.pid").read_text()) if (tmp_path / "rank0.pid").exists() else 0
    if pid:  # it had started: it is gone now (killed, and reaped by the launcher)
        assert (
            not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
        )


def test_a_rank_killed_by_a_signal_is_reported_as_a_shell_would(tmp_path: Path) -> None:
    code = "import os, signal, time\nif os.environ['RANK'] == '0':\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(60)\n"
    p = launch(2, code, tmp_path)
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

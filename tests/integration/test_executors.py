"""The serverless executors against real work: each test runs on
:class:`LocalProcessExecutor` (real ``python -m phalanx`` processes) and on
:class:`RayExecutor` (actors of a real local Ray instance with 2 CPUs, started
once for this module and shut down at its end). The replicas run real phalanx
commands: ``agent`` (succeeds, logs on stdout and stderr), ``ckpt`` (fails
with a clear code) and ``controller`` (prints its URL, then serves until
stopped)."""

from __future__ import annotations

import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import wait_for

from phalanx.launch.base import ReplicaSpec, ReplicaState, ServerlessExecutor
from phalanx.launch.local_executor import LocalProcessExecutor

END_S = 300.0
"""Bound on a replica's run, there to catch a hang: Ray workers and torch imports are
slow on 2 busy cores (a CPU-hog run once took over 60 s)."""


@pytest.fixture(scope="module")
def ray_instance() -> Iterator[ServerlessExecutor]:
    """A local Ray instance for the module, owned (and shut down) by an executor."""
    pytest.importorskip("ray")
    from phalanx.launch.ray_executor import RayExecutor

    owner = RayExecutor(num_cpus=2)
    assert owner.owns_connection
    try:
        yield owner
    finally:
        owner.close()
        import ray

        assert not ray.is_initialized()


@pytest.fixture(params=["local", "ray"])
def executor(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ServerlessExecutor]:
    ex: ServerlessExecutor
    if request.param == "local":
        ex = LocalProcessExecutor(tmp_path / "logs", grace_s=5.0)
    else:
        request.getfixturevalue("ray_instance")
        from phalanx.launch.ray_executor import RayExecutor

        ex = RayExecutor(log_dir=tmp_path / "logs")  # joins the module's instance
        assert not ex.owns_connection
    try:
        yield ex
    finally:
        ex.close()


def all_logs(ex: ServerlessExecutor, name: str) -> list[str]:
    lines, _ = ex.stream_logs(name)
    return lines


def controller_url(ex: ServerlessExecutor, name: str, since: int = 0) -> str:
    """Follow the replica's logs from line ``since`` until the controller announces its URL."""
    cursor = since
    seen: list[str] = []

    def announced() -> str | None:
        nonlocal cursor
        lines, cursor = ex.stream_logs(name, cursor)
        seen.extend(lines)
        st = ex.poll()[name]
        assert not st.ended, f"{name} ended: {st}; logs: {seen}"
        m = next((re.search(r" at (http://\S+)", ln) for ln in lines if " at http" in ln), None)
        return m.group(1) if m else None

    return str(wait_for(announced, END_S, f"{name} to print its URL", interval=0.1))


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie is gone for our purposes: it runs nothing and holds nothing.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except (FileNotFoundError, IndexError):
        return True


def test_spec_names_are_checked() -> None:
    with pytest.raises(ValueError, match="must match"):
        ReplicaSpec("a b", ["--help"])
    with pytest.raises(ValueError, match="list of strings"):
        ReplicaSpec("a", "ckpt list")  # type: ignore[arg-type]
    argv = ["ckpt", "list"]
    spec = ReplicaSpec("a", argv)
    argv.append("x")
    assert spec.argv == ["ckpt", "list"]


def test_ray_executor_says_how_to_install_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    from phalanx.launch.ray_executor import RayExecutor

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ImportError, match=re.escape("pip install 'phalanx[ray]'")):
        RayExecutor()


def test_local_launch_is_all_or_nothing(tmp_path: Path) -> None:
    with LocalProcessExecutor(tmp_path / "logs") as ex:
        good = ReplicaSpec("good", ["controller", "--state-dir", str(tmp_path / "state")])
        bad = ReplicaSpec("bad", ["ckpt", "list", "."], cwd=str(tmp_path / "no-such-dir"))
        with pytest.raises(FileNotFoundError, match="started none of"):
            ex.launch_replicas([good, bad])
        assert ex.poll() == {}


def test_replica_succeeds_with_env_cwd_and_logs(
    executor: ServerlessExecutor, tmp_path: Path
) -> None:
    worker = [sys.executable, "-c", "import os; print(os.environ['PHALANX_TEST_GREETING'])"]
    spec = ReplicaSpec(
        "ok-0",
        ["agent", "--name", "ok", "--run-dir", "agent-run", "--", *worker],
        env={"PHALANX_TEST_GREETING": "hello"},
        cwd=str(tmp_path),
    )
    assert executor.launch_replicas([spec]) == ["ok-0"]
    st = executor.collect(timeout_s=END_S)["ok-0"]
    assert (st.state, st.exit_code, st.error, st.attempt) == (ReplicaState.SUCCEEDED, 0, None, 0)
    assert st.started_at is not None and st.ended_at is not None
    assert st.started_at <= st.ended_at
    lines, cursor = executor.stream_logs("ok-0")
    text = "\n".join(lines)
    assert '"event": "done"' in text  # the agent's stdout
    assert "all workers exited 0: done" in text  # its logging, on stderr
    # The relative --run-dir landed in the spec's cwd; the worker saw the spec's env.
    assert (tmp_path / "agent-run" / "gen0" / "rank0.out").read_text() == "hello\n"
    assert executor.stream_logs("ok-0", cursor) == ([], cursor)
    assert executor.stream_logs("ok-0", 1) == (lines[1:], cursor)
    with pytest.raises(KeyError):
        executor.stream_logs("never-launched")


def test_replica_fails_with_its_exit_code(executor: ServerlessExecutor, tmp_path: Path) -> None:
    executor.launch_replicas(
        [
            ReplicaSpec("missing", ["ckpt", "inspect", str(tmp_path / "nowhere")]),
            ReplicaSpec("usage", ["ckpt", "no-such-command"]),
        ]
    )
    statuses = executor.collect(timeout_s=END_S)
    missing, usage = statuses["missing"], statuses["usage"]
    assert (missing.state, missing.exit_code) == (ReplicaState.FAILED, 1)
    assert missing.error == "exited with code 1"
    assert "must hold at least one committed checkpoint" in "\n".join(all_logs(executor, "missing"))
    assert (usage.state, usage.exit_code) == (ReplicaState.FAILED, 2)  # argparse's code
    assert "invalid choice" in "\n".join(all_logs(executor, "usage"))


def test_stream_logs_while_running_then_cancel(
    executor: ServerlessExecutor, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    executor.launch_replicas([ReplicaSpec("ctl", ["controller", "--state-dir", str(state)])])
    url = controller_url(executor, "ctl")
    assert (state / "url").read_text().strip() == url
    assert executor.poll()["ctl"].state is ReplicaState.RUNNING
    pid = executor.pid("ctl")  # type: ignore[attr-defined]
    assert pid is not None

    executor.cancel("ctl")
    st = executor.poll()["ctl"]
    assert st.state is ReplicaState.CANCELLED and st.ended_at is not None
    assert executor.collect(timeout_s=1.0)["ctl"].state is ReplicaState.CANCELLED
    if isinstance(executor, LocalProcessExecutor):
        with pytest.raises(ProcessLookupError):
            os.killpg(pid, 0)  # the whole process group is gone
    else:
        wait_for(lambda: pid_gone(pid), END_S, "the killed actor's worker to exit")
    assert any(url in ln for ln in all_logs(executor, "ctl"))  # logs outlive the replica
    executor.cancel("ctl")  # ended: nothing to do, the status stays
    assert executor.poll()["ctl"].state is ReplicaState.CANCELLED


def test_collect_timeout_names_the_live_replicas(
    executor: ServerlessExecutor, tmp_path: Path
) -> None:
    executor.launch_replicas(
        [
            ReplicaSpec("slow", ["controller", "--state-dir", str(tmp_path / "state")]),
            ReplicaSpec("quick", ["ckpt", "no-such-command"]),
        ]
    )
    wait_for(lambda: executor.poll()["quick"].ended, END_S, "quick to end")
    with pytest.raises(TimeoutError, match="still live after it: slow\\.") as e:
        executor.collect(timeout_s=0.3)
    assert "quick" not in str(e.value)
    assert not executor.poll()["slow"].ended  # collect does not stop anything
    executor.cancel()
    statuses = executor.collect(timeout_s=END_S)
    assert statuses["slow"].state is ReplicaState.CANCELLED
    assert statuses["quick"].state is ReplicaState.FAILED  # ended before: kept


def test_duplicate_names_are_refused(executor: ServerlessExecutor, tmp_path: Path) -> None:
    executor.launch_replicas([ReplicaSpec("dup", ["controller", "--state-dir", str(tmp_path)])])
    again = ReplicaSpec("dup", ["ckpt", "no-such-command"])
    with pytest.raises(ValueError, match="live replicas: dup still pending or running"):
        executor.launch_replicas([again])
    other = ReplicaSpec("other", ["ckpt", "no-such-command"])
    with pytest.raises(ValueError, match="unique within a launch: got other"):
        executor.launch_replicas([other, other])
    with pytest.raises(ValueError, match="live replicas"):
        executor.launch_replicas([other, again])  # all or nothing: other is not started
    assert set(executor.poll()) == {"dup"}
    with pytest.raises(ValueError, match="live replicas"):
        executor.relaunch("dup")
    executor.cancel("dup")
    assert executor.poll()["dup"].state is ReplicaState.CANCELLED


def test_relaunch_after_the_end(executor: ServerlessExecutor, tmp_path: Path) -> None:
    executor.launch_replicas([ReplicaSpec("again", ["ckpt", "no-such-command"])])
    first = executor.collect(timeout_s=END_S)["again"]
    assert (first.state, first.exit_code, first.attempt) == (ReplicaState.FAILED, 2, 0)
    before, cursor = executor.stream_logs("again")
    assert before and cursor == len(before)

    assert executor.relaunch("again") == "again"
    second = executor.collect(timeout_s=END_S)["again"]
    assert (second.state, second.exit_code, second.attempt) == (ReplicaState.FAILED, 2, 1)
    assert second.started_at is not None and first.ended_at is not None
    assert second.started_at >= first.ended_at
    after, end = executor.stream_logs("again", cursor)  # the old cursor carries on
    assert after == ["--- relaunch 1 of again ---", *before]
    assert end == 2 * cursor + 1
    assert executor.spec("again").argv == ["ckpt", "no-such-command"]


def test_killed_replica_fails(executor: ServerlessExecutor, tmp_path: Path) -> None:
    executor.launch_replicas([ReplicaSpec("victim", ["controller", "--state-dir", str(tmp_path)])])
    url = controller_url(executor, "victim")
    pid = executor.pid("victim")  # type: ignore[attr-defined]
    os.kill(pid, signal.SIGKILL)
    st = executor.collect(timeout_s=END_S)["victim"]
    assert st.state is ReplicaState.FAILED
    if isinstance(executor, LocalProcessExecutor):
        assert st.exit_code == -9
        assert st.error == "killed by signal 9 (SIGKILL)"
    else:
        assert st.exit_code is None
        assert st.error is not None and "actor died" in st.error
    assert any(url in ln for ln in all_logs(executor, "victim"))  # pulled before the kill
    _, cursor = executor.stream_logs("victim")
    executor.relaunch("victim")  # a restart after a crash
    assert executor.poll()["victim"].attempt == 1
    # The same state dir: the controller takes its old port again.
    assert controller_url(executor, "victim", cursor) == url
    executor.cancel()


def test_the_same_decoupled_diloco_job_runs_on_either_executor(tmp_path: Path, ray_instance):
    """One config field (``diloco.executor``) moves a decoupled DiLoCo job from
    local processes to Ray actors; with every round decided by all three slots,
    both runs end with bit-identical parameters."""
    import torch
    from safetensors.torch import load_file

    from phalanx.config import load_config
    from phalanx.launch.decoupled import DecoupledJob

    job = tmp_path / "job.toml"
    job.write_text(
        '[job]\nid = "dl"\nseed = 3\n\n[train]\nsteps = 12\nglobal_batch_size = 12\n'
        "dataset_size = 256\nin_dim = 8\nhidden = [16]\nout_dim = 2\n\n"
        '[diloco]\nmode = "objectstore"\nurl = "unset"\nsync_every = 4\nreplicas = 3\n'
        "min_replicas = 3\ngrace_s = 0.0\nray_cpus_per_replica = 0.5\n"
    )
    finals = {}
    for backend in ("local", "ray"):
        overrides = ["--diloco.executor", backend, "--diloco.url", str(tmp_path / backend)]
        cfg = load_config(job, overrides)
        run_dir = tmp_path / f"run-{backend}"
        assert DecoupledJob(str(job), cfg, run_dir, overrides).run() == 0
        finals[backend] = [load_file(run_dir / f"r{i}.safetensors") for i in range(3)]
    want = finals["local"][0]
    for got in (*finals["local"], *finals["ray"]):
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(got[k], v), k

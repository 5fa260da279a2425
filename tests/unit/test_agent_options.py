"""The elastic agent's pure parts: restart backoff, placeholders, the workers'
environment, option checks, resize requests and the CLI's errors. No workers."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from phalanx import cli, env
from phalanx.launch.agent.args import options_from_args
from phalanx.launch.agent.files import RESIZE_FILE, request_resize, take_resize
from phalanx.launch.agent.options import (
    CKPT,
    REPLICA_NAME,
    RESTART_COUNT,
    SLOT,
    AgentOptions,
    backoff_delay,
    expand,
    placeholders,
    worker_env,
)


def opts(tmp_path: Path, **kw) -> AgentOptions:
    return AgentOptions(**{"name": "r0", "cmd": ["w"], "run_dir": tmp_path, **kw})


def test_backoff_doubles_and_is_capped():
    assert [backoff_delay(k, 0.5, 4.0) for k in range(6)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0]
    assert backoff_delay(10_000, 1.0, 30.0) == 30.0
    assert backoff_delay(3, 0.0, 30.0) == 0.0
    with pytest.raises(ValueError, match="restart index must be >= 0"):
        backoff_delay(-1, 1.0, 2.0)


def test_placeholders_are_expanded_and_other_braces_kept(tmp_path: Path):
    o = opts(tmp_path, controller="http://c:1", ckpt="file:///ck")
    values = placeholders(o, rank=1, world_size=2, slot=3, port=999, restart=4)
    cmd = ["run", "--name", "{name}", "r{rank}of{world_size}", "{slot}/{restart}/{port}"]
    cmd += ["{controller}", "{ckpt}", "{run_dir}", "{x}", "{'a': {rank}}"]
    assert expand(cmd, values) == [
        "run",
        "--name",
        "r0",
        "r1of2",
        "3/4/999",
        "http://c:1",
        "file:///ck",
        str(tmp_path),
        "{x}",
        "{'a': 1}",
    ]


def test_worker_env_is_torchrun_style(tmp_path: Path):
    o = opts(tmp_path, controller="/state", ckpt="file:///ck")
    e = worker_env(o, rank=1, world_size=2, slot=5, port=1234, restart=3, base={"KEEP": "1"})
    assert e["KEEP"] == "1"
    assert (e["RANK"], e["LOCAL_RANK"], e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"]) == (
        "1",
        "1",
        "2",
        "2",
    )
    assert (e["MASTER_ADDR"], e["MASTER_PORT"]) == ("127.0.0.1", "1234")
    assert (e[REPLICA_NAME], e[RESTART_COUNT], e[SLOT], e[CKPT]) == ("r0", "3", "5", "file:///ck")
    assert e[env.CONTROLLER] == "/state"
    assert e["OMP_NUM_THREADS"] == "1"
    alone = worker_env(opts(tmp_path), rank=0, world_size=1, slot=0, port=1, restart=0, base={})
    assert "OMP_NUM_THREADS" not in alone and env.CONTROLLER not in alone and CKPT not in alone


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"name": ""}, "--name must be a non-empty replica name"),
        ({"name": "a:b"}, "--name must be a non-empty replica name"),
        ({"cmd": []}, "the worker command must follow `--`"),
        ({"nproc": 0}, "--nproc must be >= 1: got 0"),
        ({"nproc": 2, "min_nproc": 0}, "--min-nproc must be >= 1: got 0"),
        ({"nproc": 2, "min_nproc": 3}, "--min-nproc must be <= --nproc"),
        ({"max_restarts": -1}, "--max-restarts must be >= 0"),
        ({"backoff_s": -1.0}, "--backoff-s must be >= 0 seconds"),
        ({"backoff_s": float("nan")}, "--backoff-s must be >= 0 seconds"),
        ({"backoff_s": 5.0, "backoff_max_s": 1.0}, "--backoff-max-s must be >= --backoff-s"),
        ({"grace_s": -2.0}, "--grace-s must be >= 0 seconds"),
    ],
)
def test_bad_options_get_clear_errors(tmp_path: Path, kw: dict, message: str):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        opts(tmp_path, **kw).check()


def test_min_nproc_defaults_to_nproc(tmp_path: Path):
    assert opts(tmp_path, nproc=4).check().floor == 4
    assert opts(tmp_path, nproc=4, min_nproc=2).check().floor == 2


def test_resize_request_is_taken_once(tmp_path: Path):
    (tmp_path / RESIZE_FILE).write_text(json.dumps({"nproc": 3}))
    assert take_resize(tmp_path) == 3
    assert take_resize(tmp_path) is None
    for bad in ("nope", json.dumps({"n": 1}), json.dumps({"nproc": 0}), json.dumps({"nproc": 1.5})):
        (tmp_path / RESIZE_FILE).write_text(bad)
        with pytest.raises(ValueError, match="must"):
            take_resize(tmp_path)
        assert not (tmp_path / RESIZE_FILE).exists()


def test_resize_needs_a_running_agent(tmp_path: Path):
    with pytest.raises(ValueError, match="the run dir must hold a running agent"):
        request_resize(tmp_path, 1)
    (tmp_path / "agent.pid").write_text(str(os.getpid()))
    with pytest.raises(ValueError, match="--nproc must be >= 1: got 0"):
        request_resize(tmp_path, 0)


# -- the CLI ------------------------------------------------------------------------


def agent_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as e:
        cli.main(["agent", *argv])
    return str(e.value.code) + capsys.readouterr().err


def test_cli_command_must_follow_double_dash(capsys: pytest.CaptureFixture[str]):
    msg = agent_error(capsys, "--name", "r0", "python", "train.py")
    assert "the worker command must follow `--`: got 'python train.py'" in msg


def test_cli_needs_a_command_or_a_config(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    msg = agent_error(capsys, "--name", "r0", "--run-dir", str(tmp_path))
    assert "the worker command must follow `--`: got none" in msg


def test_cli_default_worker_has_the_jobs_ranks(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    job = tmp_path / "job.toml"
    job.write_text("[replica]\nranks = 2\n")
    msg = agent_error(capsys, "--name", "r0", "--config", str(job), "--nproc", "3")
    assert "--nproc times --nnodes must be the job's [replica] ranks" in msg
    assert "got --nproc 3 with --nnodes 1 and ranks = 2" in msg
    missing = agent_error(capsys, "--name", "r0", "--config", str(tmp_path / "no.toml"))
    assert "no.toml" in missing


def test_cli_controller_placeholder_needs_a_controller(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.delenv(env.CONTROLLER, raising=False)
    msg = agent_error(capsys, "--name", "r0", "--", "w", "--controller", "{controller}")
    assert "--controller must name the controller" in msg


def test_cli_bad_numbers(capsys: pytest.CaptureFixture[str]):
    msg = agent_error(capsys, "--name", "r0", "--nproc", "2", "--min-nproc", "3", "--", "w")
    assert "--min-nproc must be <= --nproc: got --min-nproc 3 with --nproc 2" in msg
    assert "invalid int value" in agent_error(capsys, "--name", "r0", "--nproc", "x", "--", "w")


def test_cli_resize_without_an_agent(capsys: pytest.CaptureFixture[str], tmp_path: Path):
    msg = agent_error(capsys, "resize", "--run-dir", str(tmp_path), "--nproc", "1")
    assert "phalanx agent resize: the run dir must hold a running agent" in msg
    assert "--run-dir (or --name) must name the agent" in agent_error(
        capsys, "resize", "--nproc", "1"
    )


def test_cli_config_overrides_reach_the_served_controller_and_the_default_worker(tmp_path: Path):
    """``--section.key=VALUE`` before ``--`` applies to the job's --config, as on every
    other command: the served controller and the default worker run the same job."""
    job = tmp_path / "job.toml"
    job.write_text("[train]\nsteps = 3\n")
    argv = ["agent", "--serve-controller", "--controller", str(tmp_path / "ctl"), "--name"]
    argv += ["r0", "--config", str(job), "--train.steps=7", "--controller-port", "7000"]
    args, overrides = cli.build_parser().parse_known_args(argv)
    opts = options_from_args(args, overrides)
    assert opts is not None and opts.serve_controller is not None
    assert list(opts.serve_controller) == [
        "--config",
        str(job),
        "--port",
        "7000",
        "--train.steps=7",
    ]
    assert opts.cmd[-1] == "--train.steps=7" and opts.cmd[3] == "replica"


def test_cli_config_overrides_that_cannot_apply_are_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
):
    job = tmp_path / "job.toml"
    job.write_text("[train]\nsteps = 3\n")
    ctl = ["--serve-controller", "--controller", str(tmp_path / "ctl"), "--config", str(job)]
    bad = agent_error(capsys, *ctl, "--train.stepz=7")
    assert bad.count("\n") <= 1 and "train.stepz" in bad
    assert "train.steps: Input should be greater than" in agent_error(
        capsys, *ctl, "--train.steps=0"
    )
    # Nothing would read them: no --config, or the caller's own worker command.
    no_config = agent_error(capsys, "--name", "r0", "--train.steps=7", "--", "w")
    assert "config overrides (--train.steps=7) apply to the job's --config" in no_config
    own = agent_error(capsys, "--name", "r0", "--config", str(job), "--train.steps=7", "--", "w")
    assert "got a worker command after `--`" in own

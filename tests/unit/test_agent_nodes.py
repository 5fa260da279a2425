"""A replica across nodes: the ranks each node's workers get (agent and ranks
launcher alike), the options' one-line errors, and the agents' rendezvous
(:mod:`phalanx.launch.agent.nodes`) in-process, over loopback."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from phalanx import cli
from phalanx.launch.agent.nodes import Follower, Leader, NodeError, NodeLink
from phalanx.launch.agent.options import AgentOptions, placeholders, worker_env
from phalanx.launch.ranks import Nodes, rank_env
from phalanx.net import LOOPBACK, parse_hostport


def opts(tmp_path: Path, **kw) -> AgentOptions:
    base = {"name": "r0", "cmd": ["w"], "run_dir": tmp_path, "nproc": 2, "nnodes": 3}
    return AgentOptions(**{**base, "master": ("10.0.0.1", 29400), **kw})


def test_workers_on_node_k_are_ranks_k_times_nproc_on_with_node_0s_address(tmp_path: Path):
    o = opts(tmp_path, node_rank=2)
    e = worker_env(o, rank=1, world_size=2, slot=1, port=555, restart=0, base={})
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")
    assert [e[k] for k in keys] == ["5", "1", "6", "2", "2"]
    assert (e["GROUP_WORLD_SIZE"], e["MASTER_ADDR"], e["MASTER_PORT"]) == ("3", "10.0.0.1", "555")
    p = placeholders(o, rank=1, world_size=2, slot=1, port=555, restart=0)
    assert (p["rank"], p["local_rank"], p["world_size"], p["node_rank"]) == ("5", "1", "6", "2")
    r = rank_env({}, 1, 2, 777, Nodes(3, 2, "10.0.0.1", 777))
    assert [r[k] for k in keys] == ["5", "1", "6", "2", "2"]
    assert (r["MASTER_ADDR"], r["MASTER_PORT"]) == ("10.0.0.1", "777")


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        (
            {"node_rank": 3},
            "--node-rank must be in [0, --nnodes): got --node-rank 3 with --nnodes 3",
        ),
        ({"nnodes": 0}, "--nnodes must be >= 1: got 0"),
        ({"master": None}, "--master-addr must name node rank 0's address"),
        ({"min_nproc": 1}, "--min-nproc applies to a replica on one node"),
        (
            {"track": "job.toml", "node_rank": 1},
            "--track must be given to the agent of node rank 0",
        ),
    ],
)
def test_bad_node_options_are_one_line(tmp_path: Path, kw: dict, message: str):
    with pytest.raises(ValueError) as e:
        opts(tmp_path, **kw).check()
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_master_addr_is_host_and_port():
    assert parse_hostport("10.0.0.1", 29400, "--master-addr") == ("10.0.0.1", 29400)
    assert parse_hostport("node-0:7", 29400, "--master-addr") == ("node-0", 7)
    assert parse_hostport("[fd00::1]:9", 29400, "--master-addr") == ("fd00::1", 9)
    for bad in ("h:0", "h:x", ":1", "a:b:c", "h:70000"):
        with pytest.raises(ValueError, match=r"--master-addr must be HOST\[:PORT\]"):
            parse_hostport(bad, 29400, "--master-addr")
    with pytest.raises(ValueError, match="--node-rank must be in"):
        Nodes(2, 2, LOOPBACK, 1).check()
    with pytest.raises(ValueError, match="--master-addr must name node rank 0"):
        Nodes(2, 1).check()


def test_the_cli_says_a_bad_node_option_in_one_line(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit) as e:
        cli.main(["agent", "--name", "r", "--nnodes", "2", "--node-rank", "2", "--", "w"])
    assert "--node-rank must be in [0, --nnodes)" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        cli.main(["agent", "--name", "r", "--nnodes", "2", "--master-addr", "h:x", "--", "w"])
    assert "--master-addr must be HOST[:PORT]" in str(e.value.code)


@pytest.fixture
def leader():
    lead = Leader("rep", 3, 2, LOOPBACK, 0)
    try:
        yield lead
    finally:
        lead.close()


def follower(lead: Leader, node: int = 1, name: str = "rep", nproc: int = 2) -> Follower:
    return Follower(name, 3, nproc, node, LOOPBACK, lead.server.server_address[1])


def test_followers_see_each_generation_and_report_failures_of_the_current_one(leader: Leader):
    f = follower(leader)
    assert f.ask().generation == -1
    leader.publish(0, 1111)
    r = f.wait(-1, timeout_s=5, stopped=lambda: False)
    assert (r.generation, r.port, r.state) == (0, 1111, "running")
    follower(leader, node=2).report(0, "worker rank 4 was killed by signal 9", False)
    got = leader.failure()
    assert (got.node, got.generation, got.unrecoverable) == (2, 0, False)
    assert leader.failure() is None  # taken once
    f.report(0, "late", False)
    leader.publish(1, 2222)
    assert leader.failure() is None  # a report of a generation that is gone
    assert f.wait(0, timeout_s=5, stopped=lambda: False).port == 2222


def test_a_follower_of_another_replica_or_layout_is_refused_in_one_line(leader: Leader):
    with pytest.raises(NodeError, match="the agents of one replica must share --name"):
        follower(leader, name="other").ask()
    with pytest.raises(NodeError, match="must have the same --nnodes and --nproc"):
        follower(leader, nproc=1).ask()


def test_the_leaders_end_reaches_its_followers_before_it_stops_serving(leader: Leader):
    link = NodeLink("rep", 3, 2, 1, (LOOPBACK, leader.server.server_address[1]))
    leader.publish(0, 1)
    assert link.news(0) is None
    ending = threading.Thread(target=leader.end, args=("failed", "rank 0 cannot run", 30.0))
    ending.start()
    told = [follower(leader, n).wait(0, 5.0, lambda: False) for n in (1, 2)]
    ending.join(timeout=5.0)  # it lingered until both were told, not its 30 s
    assert not ending.is_alive()
    assert {(r.state, r.reason) for r in told} == {("failed", "rank 0 cannot run")}
    with pytest.raises(NodeError, match=r"must start a generation within 0\.3 s"):
        follower(leader).wait(0, timeout_s=0.3, stopped=lambda: False)


def test_a_leader_must_listen_on_its_own_address():
    with pytest.raises(NodeError, match="--master-addr must be an address of node rank 0's host"):
        Leader("rep", 2, 1, "192.0.2.1", 0)  # TEST-NET-1: no host has it


def test_a_follower_with_no_leader_gives_up_after_its_timeout():
    f = Follower("rep", 2, 1, 1, LOOPBACK, 1)  # nothing listens on port 1
    with pytest.raises(NodeError, match=r"it cannot be reached"):
        f.wait(-1, timeout_s=0.3, stopped=lambda: False)


def test_an_agent_whose_node_0_never_answers_says_so_in_one_line(tmp_path: Path):
    """``phalanx agent`` of node 1 with nothing at --master-addr: exit 1, one line."""
    import subprocess
    import sys

    from phalanx.net import free_port

    argv = [sys.executable, "-m", "phalanx.cli", "agent", "--name", "r", "--run-dir", str(tmp_path)]
    argv += ["--nnodes", "2", "--node-rank", "1", "--master-addr", f"127.0.0.1:{free_port()}"]
    argv += ["--rdzv-timeout-s", "0.5", "--", sys.executable, "-c", "pass"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "the replica's node rank 0 agent must start a generation within 0.5 s" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert json.loads(done.stdout.splitlines()[-1])["event"] == "failed"

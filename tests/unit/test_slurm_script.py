"""deploy/slurm/phalanx.sbatch: the commands it runs for a node list (its dry run,
PHALANX_DRY_RUN=1, prints them instead), parsed with phalanx's own command line:
the controller on the first node, one agent per replica on the right nodes and
het group, each given the controller's URL; bad input is one line and a non-zero
exit."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from phalanx.cli import build_parser
from phalanx.config import load_config
from phalanx.launch.agent.args import options_from_args
from phalanx.launch.agent.options import AgentOptions, expand

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "slurm" / "phalanx.sbatch"
EXAMPLES = ROOT / "examples"


def dry_run(config: str | Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The script's dry run with these Slurm variables (and nothing of the caller's)."""
    base = {
        "PATH": os.environ["PATH"],
        "PHALANX_DRY_RUN": "1",
        "PHALANX_PYTHON": sys.executable,
        "PHALANX_JOB_DIR": "/shared/jobs/j1",
    }
    return subprocess.run(
        ["bash", str(SCRIPT), str(config), *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


Step = tuple[dict[str, str], list[str]]


def steps(out: str) -> list[Step]:
    """Each printed `srun OPTIONS [env K=V ...] CMD...` as (its srun options, CMD)."""
    rows = []
    for line in out.splitlines():
        words = shlex.split(line)
        assert words[0] == "srun", line
        i = 1
        opts: dict[str, str] = {}
        while words[i].startswith("--"):
            key, _, value = words[i].partition("=")
            opts[key] = value
            i += 1
        if words[i] == "env":
            i += 1
            while "=" in words[i]:
                key, _, value = words[i].partition("=")
                opts[f"env:{key}"] = value
                i += 1
        rows.append((opts, words[i:]))
    return rows


def agent_of(cmd: list[str]) -> tuple[AgentOptions, dict[str, object], list[str]]:
    """An agent command as `phalanx agent` reads it, and the `phalanx replica` it runs
    (placeholders expanded as the agent does): (options, replica's args, overrides)."""
    assert cmd[:2] == ["phalanx", "agent"], cmd
    opts = options_from_args(build_parser().parse_args(cmd[1:]))
    assert opts is not None
    worker = expand(opts.cmd, {"controller": opts.controller or "", "name": opts.name})
    assert worker[:2] == ["phalanx", "replica"], worker
    args, overrides = build_parser().parse_known_args(worker[1:])
    return opts, vars(args), overrides


def is_controller(step: Step) -> bool:
    return step[1][:3] == ["phalanx", "agent", "--serve-controller"]


def controller_of(step: Step) -> tuple[Any, list[str]]:
    """A controller's step (``phalanx agent --serve-controller``, its overrides before
    ``--``) as the ``phalanx controller`` command the agent runs: (its parsed command
    line, with the address it advertises, and its config overrides)."""
    opts, cmd = step
    assert is_controller(step), cmd
    args, overrides = build_parser().parse_known_args(cmd[1:])
    agent = options_from_args(args, overrides)
    assert agent is not None and agent.controller_only and agent.serve_controller is not None
    served = ["controller", "--state-dir", str(agent.controller), *agent.serve_controller]
    ctl, ctl_overrides = build_parser().parse_known_args(served)
    ctl.advertise_host = opts["env:PHALANX_ADVERTISE_HOST"]
    ctl.agent_run_dir = agent.run_dir
    return ctl, ctl_overrides


def started(config: str | Path, *args: str, **env: str) -> tuple[Step, Any, list[str], list[Step]]:
    """A dry run that must succeed: the controller's step, its parsed command line and
    config overrides, and the agents' steps."""
    r = dry_run(config, *args, **env)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    first, *agents = steps(r.stdout)
    ctl, overrides = controller_of(first)
    return first, ctl, overrides, agents


def test_the_script_is_valid_bash():
    r = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    head = SCRIPT.read_text().split("\nset ", 1)[0]
    # Two components: policy (with the controller) and rollout.
    assert head.count("\n#SBATCH hetjob\n") == 1


def test_an_rl_job_runs_the_controller_on_the_first_node_and_each_role_on_its_group():
    (ctl_opts, _), ctl, ctl_overrides, agents = started(
        EXAMPLES / "sort_grpo.toml",
        "--rl.grpo.steps=10",
        SLURM_JOB_NODELIST_HET_GROUP_0="gpu[01-02]",
        SLURM_JOB_NODELIST_HET_GROUP_1="gpu[09-10],cpu7",
        SLURM_HET_SIZE="2",
        PHALANX_ROLLOUT_PER_NODE="2",
        PHALANX_GPUS_PER_ROLLOUT="1",
    )

    # The controller: on gpu01, in group 0, sharing the node with its policy replica.
    assert ctl_opts["--nodelist"] == "gpu01" and ctl_opts["--het-group"] == "0"
    assert "--overlap" in ctl_opts and ctl_opts["--ntasks"] == "1"
    assert (ctl.host, ctl.port, ctl.advertise_host) == ("0.0.0.0", 8470, "gpu01")
    assert ctl.state_dir == "/shared/jobs/j1/controller"
    assert ctl.config == str(EXAMPLES / "sort_grpo.toml")
    assert ctl_overrides == ["--rl.grpo.steps=10"]

    placed = []
    for opts, cmd in agents:
        agent, replica, overrides = agent_of(cmd)
        # Every replica is given the URL of the controller's node and port.
        assert agent.controller == replica["controller"] == "http://gpu01:8470"
        assert replica["name"] == agent.name and replica["config"] == ctl.config
        assert overrides == ["--rl.grpo.steps=10"]
        assert opts["--nodelist"] == agent.node == opts["env:PHALANX_ADVERTISE_HOST"]
        assert agent.run_dir == Path(f"/shared/jobs/j1/agent-{agent.name}")
        placed.append((replica["role"], opts["--het-group"], agent.node, agent.name, agent.nproc))
        assert ("--gpus" in opts) == (replica["role"] == "rollout")
    assert placed == [
        ("policy", "0", "gpu01", "policy-0", 1),
        ("policy", "0", "gpu02", "policy-1", 1),
        ("rollout", "1", "gpu09", "rollout-0", 1),
        ("rollout", "1", "gpu09", "rollout-1", 1),
        ("rollout", "1", "gpu10", "rollout-2", 1),
        ("rollout", "1", "gpu10", "rollout-3", 1),
        ("rollout", "1", "cpu7", "rollout-4", 1),
        ("rollout", "1", "cpu7", "rollout-5", 1),
    ]
    # Two rollout replicas on a node split it (--exact), one GPU each.
    rollout_opts = [o for o, _ in agents[2:]]
    assert all(o["--exact"] == "" and o["--gpus"] == "1" for o in rollout_opts)


def test_a_training_job_runs_replicas_of_its_ranks_on_every_node():
    (ctl_opts, _), ctl, _, agents = started(
        EXAMPLES / "ft_hsdp.toml",
        SLURM_JOB_NODELIST="n[1-2,08-10],login",
        PHALANX_PORT="9000",
        PHALANX_ADVERTISE_HOST="iface:ib0",
    )
    assert "--het-group" not in ctl_opts and ctl_opts["--nodelist"] == "n1"
    assert (ctl.port, ctl.advertise_host) == (9000, "n1")
    got = []
    for opts, cmd in agents:
        agent, replica, _ = agent_of(cmd)
        assert agent.controller == "http://n1:9000"
        assert opts["env:PHALANX_ADVERTISE_HOST"] == "iface:ib0"
        assert "--het-group" not in opts and "--exact" not in opts
        got.append((opts["--nodelist"], replica["role"], agent.nproc))
    # [replica] ranks = 2: each node's agent starts both ranks of its replica.
    assert got == [(n, "policy", 2) for n in ("n1", "n2", "n08", "n09", "n10", "login")]


def test_a_role_given_fewer_replicas_than_n_init_starts_its_first_quorum_with_those(tmp_path):
    # ft_mlp.toml: n_init_replicas = 3, min_replicas = 1; two nodes give two replicas.
    _, ctl, ctl_overrides, agents = started(EXAMPLES / "ft_mlp.toml", SLURM_JOB_NODELIST="a1,a2")
    assert ctl_overrides == ["--roles.policy.n_init_replicas=2"]
    assert load_config(ctl.config, ctl_overrides).roles["policy"].n_init_replicas == 2
    assert [agent_of(cmd)[2] for _, cmd in agents] == [ctl_overrides] * 2
    # Fewer than min_replicas could never step: refused.
    three = tmp_path / "three.toml"
    three.write_text("[roles.policy]\nmin_replicas = 3\nn_init_replicas = 3\n")
    r = dry_run(three, SLURM_JOB_NODELIST="a1,a2")
    assert r.returncode != 0 and r.stdout == "" and r.stderr.count("\n") == 1
    assert "roles.policy.min_replicas in the job config must be <= 2, got 3" in r.stderr


@pytest.mark.parametrize(
    ("override", "says"),
    [
        # No GPU info (a CPU cluster): one policy replica per node still bounds them.
        (
            "--roles.policy.min_replicas=3",
            "roles.policy.min_replicas in the job config must be <= 2, got 3",
        ),
        ("--replica.ranks=two", "replica.ranks in the job config must be integers"),
    ],
)
def test_overrides_are_checked_against_the_allocation_as_the_file_is(override, says):
    r = dry_run(EXAMPLES / "ft_mlp.toml", override, SLURM_JOB_NODELIST="a1,a2")
    assert r.returncode != 0 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert says in r.stderr
    # With GPU info, an override of the ranks is held to it as the file's would be.
    r = dry_run(
        EXAMPLES / "ft_mlp.toml",
        "--replica.ranks=4",
        SLURM_JOB_NODELIST="a1",
        SLURM_GPUS_ON_NODE="2",
    )
    assert r.returncode != 0 and r.stderr.count("\n") == 1
    assert "[replica] ranks = 4 in the job config" in r.stderr, r.stderr


def test_https_when_given_a_certificate():
    r = dry_run(
        EXAMPLES / "ft_mlp.toml",
        SLURM_JOB_NODELIST="a1,a2",
        PHALANX_TLS_CERT="/certs/ctl.pem",
        PHALANX_TLS_KEY="/certs/ctl.key",
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr
    (_, ctl_cmd), *agents = steps(r.stdout)
    # The served controller's files (the agent checks them where they exist: the nodes).
    ctl = build_parser().parse_known_args(ctl_cmd[1:])[0]
    assert ctl.serve_controller and (ctl.tls_cert, ctl.tls_key) == (
        "/certs/ctl.pem",
        "/certs/ctl.key",
    )
    assert {agent_of(cmd)[0].controller for _, cmd in agents} == {"https://a1:8470"}


@pytest.mark.parametrize(
    ("config", "env", "says"),
    [
        ("/no/such/job.toml", {"SLURM_JOB_NODELIST": "n1"}, "job config '/no/such/job.toml' must"),
        ("ft_mlp.toml", {"SLURM_JOB_NODELIST": ""}, "the node list must name at least one node"),
        ("ft_mlp.toml", {}, "the node list must name at least one node"),
        ("ft_mlp.toml", {"SLURM_JOB_NODELIST": ","}, "must name at least one node"),
        ("ft_mlp.toml", {"SLURM_JOB_NODELIST": "n[1-3"}, "node list must be Slurm's syntax"),
        ("sort_grpo.toml", {"SLURM_JOB_NODELIST": "n1"}, "[roles.rollout]"),
        (
            "ft_mlp.toml",
            {"SLURM_JOB_NODELIST_HET_GROUP_0": "a1", "SLURM_JOB_NODELIST_HET_GROUP_1": "b1"},
            "the job config has no [roles.rollout]",
        ),
        ("ft_mlp.toml", {"SLURM_JOB_NODELIST": "n1", "PHALANX_PORT": "http"}, "PHALANX_PORT"),
        # More replicas than nodes x GPUs: a policy replica's ranks on a node's GPUs,
        # and a node's rollout replicas.
        (
            "ft_hsdp.toml",
            {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_GPUS_ON_NODE": "1"},
            "a policy replica has [replica] ranks = 2 in the job config, one GPU each: a "
            "node of the allocation has 1",
        ),
        (
            "sort_grpo.toml",
            {
                "SLURM_JOB_NODELIST_HET_GROUP_0": "a1",
                "SLURM_JOB_NODELIST_HET_GROUP_1": "b1",
                "SLURM_GPUS_PER_NODE": "h100:2",
                "PHALANX_ROLLOUT_PER_NODE": "3",
            },
            "PHALANX_ROLLOUT_PER_NODE=3 rollout replicas of 1 GPU(s) need 3 GPUs on a node",
        ),
        ("ft_mlp.toml", {"SLURM_JOB_NODELIST": "n1", "SLURM_GPUS_ON_NODE": "x"}, "a GPU count"),
    ],
)
def test_bad_input_is_one_line_and_a_nonzero_exit(config, env, says):
    r = dry_run(EXAMPLES / config, **env)
    assert r.returncode != 0
    assert r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("phalanx.sbatch: "), r.stderr
    assert says in lines[0]


def test_a_config_that_is_not_toml_is_one_line(tmp_path):
    bad = tmp_path / "job.toml"
    bad.write_text("[job\nid = 1\n")
    r = dry_run(bad, SLURM_JOB_NODELIST="n1")
    assert r.returncode != 0 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and f"job config '{bad}' must be TOML" in r.stderr


def _controllers_and_etcd(out: str) -> tuple[list[Step], list[Step], list[Step]]:
    """The printed steps as (etcd members, controllers, agents)."""
    rows = steps(out)
    members = [s for s in rows if s[1][0] == "etcd"]
    ctls = [s for s in rows if is_controller(s)]
    agents = [s for s in rows if s[1][:2] == ["phalanx", "agent"] and not is_controller(s)]
    assert len(members) + len(ctls) + len(agents) == len(rows)
    return members, ctls, agents


def test_an_etcd_journal_runs_etcd_on_three_nodes_and_a_standby_on_the_second():
    r = dry_run(
        EXAMPLES / "ft_hsdp.toml",
        SLURM_JOB_NODELIST="n[1-4]",
        PHALANX_ETCD="nodes",
        PHALANX_ETCD_PORT="3379",
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr
    members, ctls, agents = _controllers_and_etcd(r.stdout)
    journal = "etcd://n1:3379,n2:3379,n3:3379"
    # One etcd member on each of the first three nodes, naming the whole cluster.
    assert [o["--nodelist"] for o, _ in members] == ["n1", "n2", "n3"]
    for (opts, cmd), node in zip(members, ["n1", "n2", "n3"], strict=True):
        flags = dict(zip(cmd[1::2], cmd[2::2], strict=True))
        assert "--overlap" in opts and flags["--name"] == node
        assert flags["--advertise-client-urls"] == f"http://{node}:3379"
        assert flags["--initial-advertise-peer-urls"] == f"http://{node}:3380"
        assert flags["--initial-cluster"] == ",".join(f"n{i}=http://n{i}:3380" for i in (1, 2, 3))
        assert flags["--data-dir"] == f"/shared/jobs/j1/etcd-{node}"
    # The controller on the first node and a standby on the second, each with its
    # own state dir and the journal in the etcd.
    got = []
    for opts, cmd in ctls:
        ctl, overrides = controller_of((opts, cmd))
        assert opts["--nodelist"] == ctl.advertise_host and "--overlap" in opts
        assert overrides == [f"--controller.journal={journal}"]
        assert load_config(ctl.config, overrides).controller.journal == journal
        got.append((ctl.advertise_host, ctl.state_dir))
    assert got == [
        ("n1", "/shared/jobs/j1/controller"),
        ("n2", "/shared/jobs/j1/controller-standby"),
    ]
    # Every replica is given both controllers' URLs: it follows the leader.
    for _, cmd in agents:
        agent, replica, overrides = agent_of(cmd)
        assert agent.controller == replica["controller"] == "http://n1:8470,http://n2:8470"
        assert overrides == [f"--controller.journal={journal}"]
    assert len(agents) == 4


def test_your_own_etcd_is_named_by_url_and_none_is_started():
    r = dry_run(
        EXAMPLES / "ft_mlp.toml",
        "--train.steps=5",
        SLURM_JOB_NODELIST="a1,a2",
        PHALANX_ETCD="etcd://etcd1:2379,etcd2:2379/jobs",
    )
    assert r.returncode == 0 and r.stderr == "", r.stderr
    members, ctls, agents = _controllers_and_etcd(r.stdout)
    assert members == [] and [o["--nodelist"] for o, _ in ctls] == ["a1", "a2"]
    overrides = agent_of(agents[0][1])[2]
    assert "--controller.journal=etcd://etcd1:2379,etcd2:2379/jobs" in overrides


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"SLURM_JOB_NODELIST": "a1", "PHALANX_ETCD": "nodes"}, "a standby controller on a second"),
        ({"SLURM_JOB_NODELIST": "a1,a2", "PHALANX_ETCD": "nodes"}, "etcd on three nodes"),
        ({"SLURM_JOB_NODELIST": "a1,a2", "PHALANX_ETCD": "http://e:2379"}, "PHALANX_ETCD must"),
        (
            {"SLURM_JOB_NODELIST": "a[1-3]", "PHALANX_ETCD": "nodes", "PHALANX_ETCD_PORT": "x"},
            "PHALANX_ETCD_PORT must",
        ),
    ],
)
def test_an_etcd_setting_that_cannot_work_is_one_line(env, says):
    r = dry_run(EXAMPLES / "ft_mlp.toml", **env)
    assert r.returncode != 0 and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("phalanx.sbatch: ") and says in lines[0], (
        r.stderr
    )


def test_replicas_that_fit_the_nodes_gpus_start():
    """One policy replica of 2 ranks per node of 2 GPUs, two rollout replicas of one GPU
    per node of 2 GPUs: it fits, and nothing is refused."""
    _, _, _, agents = started(
        EXAMPLES / "ft_hsdp.toml", SLURM_JOB_NODELIST="n[1-2]", SLURM_GPUS_ON_NODE="2"
    )
    assert [agent_of(cmd)[0].nproc for _, cmd in agents] == [2, 2]
    _, _, _, agents = started(
        EXAMPLES / "sort_grpo.toml",
        SLURM_JOB_NODELIST_HET_GROUP_0="a1",
        SLURM_JOB_NODELIST_HET_GROUP_1="b1",
        SLURM_GPUS_PER_NODE="2",
        PHALANX_ROLLOUT_PER_NODE="2",
    )
    assert len(agents) == 3

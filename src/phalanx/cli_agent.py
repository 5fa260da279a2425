"""``phalanx agent``'s parser and entry (the agent itself is
:mod:`phalanx.launch.agent.supervisor`). Standard library only at import, like
:mod:`phalanx.cli`: the agent is imported when the command runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from phalanx.cli_net import add_advertise_host, add_controller, add_tls


def add_agent_parser(sub: Any, fn: Callable[[argparse.Namespace, list[str]], int]) -> None:
    """Add ``agent`` to ``sub`` (the subparsers of ``phalanx``), run by ``fn``."""
    a = sub.add_parser(
        "agent",
        help="run one replica's workers on this node; report and restart them when they fail",
        description="The elastic agent: start --nproc workers of one replica with torchrun's "
        "environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT), report a worker's exit "
        "to the controller at once, restart the workers with backoff, and change their layout "
        "(checkpoint, restart, reshard-load, rejoin) when a slot is lost or on request: "
        "`phalanx agent resize --run-dir DIR --nproc N`. CMD may use {name} {rank} "
        "{local_rank} {world_size} {node_rank} {nnodes} {slot} {restart} {port} {run_dir} "
        "{controller} {ckpt}. "
        "One JSON line per event on stdout.",
    )
    add_controller(a)
    a.add_argument("--config", help="job TOML; without CMD, the worker is `phalanx replica`")
    a.add_argument("--name", help="stable name of the replica")
    a.add_argument("--nproc", type=int, default=1, help="workers of the replica (default 1)")
    a.add_argument("--min-nproc", type=int, help="fewest workers after lost slots (default N)")
    a.add_argument("--max-restarts", type=int, default=3, help="restarts after failures (3)")
    a.add_argument("--backoff-s", type=float, default=1.0, help="first restart delay (1 s)")
    a.add_argument("--backoff-max-s", type=float, default=30.0, help="longest delay (30 s)")
    a.add_argument("--grace-s", type=float, default=30.0, help="SIGTERM to SIGKILL (30 s)")
    a.add_argument("--ckpt", help="checkpoint URL for the workers ($PHALANX_CKPT, {ckpt})")
    a.add_argument("--run-dir", help="pid file, control files, logs (default runs/agent-NAME)")
    a.add_argument("--node", help="this node's name in reports (default the hostname)")
    a.add_argument(
        "--serve-controller",
        action="store_true",
        help="also run the job's controller (--config) on the state dir --controller names, "
        "and start it again on that dir and port when it dies; without a worker command "
        "or --name, run the controller only",
    )
    a.add_argument(
        "--controller-host",
        metavar="HOST",
        help="with --serve-controller: the address the controller binds (default 127.0.0.1; "
        "0.0.0.0 for replicas on other hosts, with --advertise-host)",
    )
    a.add_argument(
        "--controller-port",
        type=int,
        metavar="PORT",
        help="with --serve-controller: the port it binds (default a free one, kept across "
        "its restarts)",
    )
    nodes = a.add_argument_group(
        "a replica across nodes",
        "one agent per node, each with --nproc workers; node 0's agent leads (it runs rank "
        "0 and says which generation runs where), the others follow it",
    )
    nodes.add_argument("--nnodes", type=int, default=1, help="nodes the replica spans (1)")
    nodes.add_argument("--node-rank", type=int, default=0, help="this node's place, 0..N-1 (0)")
    nodes.add_argument(
        "--master-addr",
        metavar="HOST[:PORT]",
        help="node rank 0's address, which every node reaches, and its agent's rendezvous "
        "port (default 29400); with --advertise-host, so that ranks on other nodes reach this "
        "one's",
    )
    nodes.add_argument(
        "--rdzv-timeout-s",
        type=float,
        default=300.0,
        help="how long a node other than 0 waits for node 0's agent (300 s)",
    )
    a.add_argument(
        "--track",
        action="store_true",
        help="log the job's metrics as --config's [track] says (TensorBoard, wandb, MLflow "
        "under --run-dir): give it to one agent of the job, of node rank 0",
    )
    add_tls(a)
    add_advertise_host(a)
    a.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD", help="the worker command")
    a.set_defaults(fn=fn)


def run_agent(args: argparse.Namespace, overrides: list[str]) -> int:
    """``phalanx agent [OPTIONS] [--section.key=VALUE ...] -- CMD ...`` and ``phalanx
    agent resize ...``. The overrides apply to the job's ``--config``: the served
    controller's and the default worker's (``phalanx replica``)."""
    from phalanx.launch.agent.args import options_from_args
    from phalanx.launch.agent.supervisor import Agent
    from phalanx.launch.agent.workers import AgentError
    from phalanx.log import setup

    opts = options_from_args(args, overrides)
    if opts is None:
        return 0  # a resize request, sent
    setup()
    try:
        return Agent(opts).run()
    except AgentError as e:
        raise SystemExit(f"phalanx agent: {e}") from None

"""``phalanx agent``'s command line as :class:`~phalanx.launch.agent.options.AgentOptions`:
each option checked, the served controller's arguments and the job's config overrides
passed on, bad input one line (SystemExit). Nothing is started here."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from phalanx import env
from phalanx.launch.agent.files import default_run_dir, resize_main
from phalanx.launch.agent.options import AgentOptions


def served_controller_args(args: Any, serving: bool) -> list[str]:
    """The served controller's own options (``--controller-host``, ``--controller-port``,
    ``--tls-cert``/``--tls-key``) as ``phalanx controller`` arguments, checked here so
    that a bad one is one line of the agent's, not a controller that fails to start.
    Without ``--serve-controller`` they are refused."""
    given = [
        flag
        for flag, value in (
            ("--controller-host", getattr(args, "controller_host", None)),
            ("--controller-port", getattr(args, "controller_port", None)),
            ("--tls-cert", getattr(args, "tls_cert", None)),
            ("--tls-key", getattr(args, "tls_key", None)),
        )
        if value is not None
    ]
    if not given:
        return []
    if not serving:
        raise SystemExit(
            f"phalanx agent: {', '.join(given)} set up the controller the agent serves: pass "
            f"--serve-controller too, or drop them."
        )
    out: list[str] = []
    if args.controller_host is not None:
        out += ["--host", args.controller_host]
    port = args.controller_port
    if port is not None:
        if not 0 <= port <= 65535:
            raise SystemExit(
                f"phalanx agent: --controller-port must be a TCP port, 0 to 65535 (0 picks a "
                f"free one): got {port}."
            )
        out += ["--port", str(port)]
    from phalanx.cli_net import tls_files

    tls = tls_files(args, "agent")
    if tls is not None:
        out += ["--tls-cert", tls[0], "--tls-key", tls[1]]
    return out


def options_from_args(args: Any, overrides: Sequence[str] = ()) -> AgentOptions | None:
    """The options of ``phalanx agent`` (``args.cmd``: everything after the options,
    ``--`` included). ``overrides`` (``--section.key=VALUE``, before ``--``) apply to
    ``--config`` as everywhere: the served controller and the default worker are given
    them, so that both run the same job. A ``resize`` request is sent here and gives
    None. Bad input raises SystemExit with one clear line."""
    import sys

    rest = list(args.cmd)
    if rest and rest[0] == "resize":
        resize_main(rest[1:], args.run_dir)
        return None
    if rest and rest[0] != "--":
        raise SystemExit(
            f"phalanx agent: the worker command must follow `--`: got {' '.join(rest)!r}. "
            f"Write `phalanx agent [OPTIONS] -- {' '.join(rest)}`."
        )
    cmd = rest[1:]
    controller = args.controller or os.environ.get(env.CONTROLLER)
    serving = bool(getattr(args, "serve_controller", False))
    served = served_controller_args(args, serving)
    overrides = list(overrides)
    serve = ("--config", args.config, *served, *overrides) if serving and args.config else None
    if serving and not args.config:
        raise SystemExit(
            "phalanx agent: --serve-controller must have the job's --config (the controller "
            "runs that job): got none."
        )
    default_worker = not cmd and args.config and (args.name or not serve)
    check_overrides(args.config, overrides, applied=bool(serve or default_worker))
    if default_worker:
        from phalanx.config import ConfigError, load_config

        try:
            ranks = load_config(args.config, overrides).replica.ranks
        except ConfigError as e:
            raise SystemExit(f"phalanx agent: {e}") from None
        nnodes = getattr(args, "nnodes", 1)
        if args.nproc * nnodes != ranks:
            raise SystemExit(
                f"phalanx agent: --nproc times --nnodes must be the job's [replica] ranks for "
                f"the default worker (`phalanx replica`): got --nproc {args.nproc} with "
                f"--nnodes {nnodes} and ranks = {ranks} in {args.config}. Pass --nproc "
                f"{ranks // nnodes if ranks % nnodes == 0 else ranks}, or a command after `--`."
            )
        cmd = [
            sys.executable,
            "-m",
            "phalanx.cli",
            "replica",
            "--config",
            args.config,
            "--controller",
            "{controller}",
            "--name",
            "{name}",
            *overrides,
        ]
    if "{controller}" in " ".join(cmd) and not controller:
        raise SystemExit(
            f"phalanx agent: --controller must name the controller (URL or state dir) for a "
            f"command with {{controller}}: got none. Pass --controller or set ${env.CONTROLLER}."
        )
    try:
        return AgentOptions(
            name=args.name or "",
            cmd=cmd,
            run_dir=Path(args.run_dir)
            if args.run_dir
            else default_run_dir(args.name or ("controller" if serve else "_")),
            controller=controller,
            nproc=args.nproc,
            min_nproc=args.min_nproc,
            max_restarts=args.max_restarts,
            backoff_s=args.backoff_s,
            backoff_max_s=args.backoff_max_s,
            grace_s=args.grace_s,
            ckpt=args.ckpt,
            serve_controller=serve,
            **({"node": args.node} if args.node else {}),
            **node_options(args),
        ).check()
    except ValueError as e:
        raise SystemExit(f"phalanx agent: {e}") from None


def check_overrides(config: str | None, overrides: list[str], *, applied: bool) -> None:
    """Refuse, in one line, overrides that nothing would read (no ``--config``, or a
    worker command of the caller's and no served controller) or that the job's config
    rejects, before anything starts."""
    if not overrides:
        return
    if not config or not applied:
        raise SystemExit(
            f"phalanx agent: config overrides ({' '.join(overrides)}) apply to the job's "
            f"--config, for the served controller and the default worker: got "
            f"{'no --config' if not config else 'a worker command after `--`'}. Pass --config "
            f"(and --serve-controller or no command), or put them in your command."
        )
    from phalanx.config import ConfigError, load_config

    try:
        load_config(config, overrides)
    except ConfigError as e:
        raise SystemExit(f"phalanx agent: {e}") from None


def node_options(args: Any) -> dict[str, Any]:
    """The options of a replica across nodes, and ``--track``, as :class:`AgentOptions`
    fields. Raises ValueError in one line."""
    from phalanx.launch.agent.nodes import DEFAULT_PORT
    from phalanx.net import parse_hostport

    spec = getattr(args, "master_addr", None)
    track = getattr(args, "track", False)
    if track and not args.config:
        raise ValueError(
            "--track logs the job's metrics as its [track] section says: pass the job's "
            "--config too."
        )
    return {
        "nnodes": getattr(args, "nnodes", 1),
        "node_rank": getattr(args, "node_rank", 0),
        "master": parse_hostport(spec, DEFAULT_PORT, "--master-addr") if spec else None,
        "rdzv_timeout_s": getattr(args, "rdzv_timeout_s", 300.0),
        "track": args.config if track else None,
    }

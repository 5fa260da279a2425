"""``phalanx ...`` entry points. Thin: heavy modules are imported inside commands,
so that ``phalanx --help`` answers at once."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _controller(args: argparse.Namespace, overrides: list[str]) -> int:
    from phalanx.config import load_config
    from phalanx.controller.server import serve

    cfg = load_config(args.config, overrides)
    serve(cfg, Path(args.state_dir), host=args.host, port=args.port)
    return 0


def _status(args: argparse.Namespace, overrides: list[str]) -> int:
    import httpx

    from phalanx.client import find_token, resolve

    url, state_dir = resolve(args.controller)
    token = find_token(state_dir)
    r = httpx.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    r.raise_for_status()
    print(json.dumps(r.json(), indent=2))
    return 0


def _replica(args: argparse.Namespace, overrides: list[str]) -> int:
    import os

    from phalanx import env
    from phalanx.config import load_config
    from phalanx.log import setup

    setup()
    cfg = load_config(args.config, overrides)
    controller = args.controller or os.environ.get(env.CONTROLLER)
    if not controller:
        raise SystemExit(
            f"phalanx replica: --controller must name the controller (URL or state dir): got "
            f"none. Pass --controller or set ${env.CONTROLLER}."
        )
    name = args.name or f"{args.role}-{os.getpid()}"
    if args.role != "policy":
        raise SystemExit(
            f"phalanx replica: --role must be 'policy' for the FT-DDP job: got {args.role!r}."
        )
    from phalanx.train.job import run_replica

    return run_replica(cfg, controller, name, Path(args.out) if args.out else None)


def _run(args: argparse.Namespace, overrides: list[str]) -> int:
    import time

    from phalanx.config import load_config
    from phalanx.launch.local import Chaos, LocalJob

    cfg = load_config(args.config, overrides)
    try:
        chaos = Chaos.parse(args.chaos) if args.chaos else None
    except ValueError as e:
        raise SystemExit(f"phalanx run: {e}") from None
    replicas = args.replicas or cfg.roles["policy"].n_init_replicas
    run_dir = Path(args.run_dir or f"runs/{cfg.job.id}-{time.strftime('%Y%m%d-%H%M%S')}")
    job = LocalJob(args.config, cfg, run_dir, overrides, replicas, chaos)
    return job.run(live=not args.plain)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="phalanx",
        description="Elastic, fault-tolerant training and RL post-training.",
    )
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser(
        "controller",
        help="run a job's controller (membership, quorum, commands, status)",
        description="Run the job's controller. Prints and writes to STATE_DIR/url the URL it "
        "listens on. Extra --section.key VALUE arguments override the job config.",
    )
    c.add_argument("--config", help="job TOML file (defaults apply when omitted)")
    c.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    c.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one")
    c.add_argument("--state-dir", required=True, help="where the journal, token and URL live")
    c.set_defaults(fn=_controller)

    r = sub.add_parser(
        "replica",
        help="run one replica of a job and attach it to the job's controller",
        description="Run one replica. Extra --section.key VALUE arguments override the job config.",
    )
    r.add_argument("--config", help="job TOML file")
    r.add_argument("--controller", help="controller URL or state dir ($PHALANX_CONTROLLER)")
    r.add_argument("--role", default="policy", help="role to join (default policy)")
    r.add_argument("--name", help="stable replica name (default ROLE-PID)")
    r.add_argument("--out", help="write the final model/optimizer state here (safetensors)")
    r.set_defaults(fn=_replica)

    u = sub.add_parser(
        "run",
        help="run a whole job locally: controller + replicas, with live progress",
        description="Start the controller and the job's replicas as local processes and show "
        "progress. Extra --section.key VALUE arguments override the job config.",
    )
    u.add_argument("config", help="job TOML file")
    u.add_argument("--replicas", type=int, help="policy replicas (default: n_init_replicas)")
    u.add_argument("--chaos", help="kill-every=SECONDS[,restart-after=SECONDS][,seed=N]")
    u.add_argument("--run-dir", help="where logs and state go (default runs/JOB-TIME)")
    u.add_argument("--plain", action="store_true", help="plain log lines instead of a live table")
    u.set_defaults(fn=_run)

    s = sub.add_parser("status", help="print a job's status as JSON")
    s.add_argument("--controller", required=True, help="controller URL or state dir")
    s.set_defaults(fn=_status)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("controller", "replica", "run"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from phalanx.config import ConfigError

    try:
        return args.fn(args, extra)
    except ConfigError as e:
        print(f"phalanx: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from phalanx.client import ControllerError
        from phalanx.controller.journal import StateDirLocked

        if isinstance(e, StateDirLocked | ControllerError | OSError):
            print(f"phalanx: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())

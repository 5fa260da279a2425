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

    s = sub.add_parser("status", help="print a job's status as JSON")
    s.add_argument("--controller", required=True, help="controller URL or state dir")
    s.set_defaults(fn=_status)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("controller",):
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

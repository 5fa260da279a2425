"""``phalanx ...`` entry points. Thin: heavy modules are imported inside commands,
so that ``phalanx --help`` answers at once."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _controller(args: argparse.Namespace, overrides: list[str]) -> int:
    from phalanx.cli_net import check_advertised_bind
    from phalanx.config import load_config
    from phalanx.controller import serve

    check_advertised_bind(args)
    cfg = load_config(args.config, overrides)
    tls = (args.tls_cert, args.tls_key)
    serve(cfg, Path(args.state_dir), args.host, args.port, args.fresh, *tls)
    return 0


ROLES = ("policy", "rollout")
"""Replica roles (as in :data:`phalanx.config.ROLE_NAMES`; not imported, to keep ``--help`` fast)."""


def _status(args: argparse.Namespace, overrides: list[str]) -> int:
    from phalanx.cli_net import controller_of
    from phalanx.console.poll import fetch_status
    from phalanx.console.view import status_text

    controller = controller_of(args, "status")
    if args.watch and not args.json:
        from phalanx.console.status_view import watch

        watch(lambda: fetch_status(controller), args.interval)
        return 0
    while True:
        st = fetch_status(controller)
        if args.json:
            print(st.model_dump_json(indent=2 if not args.watch else None), flush=True)
        elif sys.stdout.isatty():
            from rich.console import Console

            from phalanx.console.status_view import status_tables

            Console().print(status_tables(st))
        else:
            print(status_text(st))
        if not args.watch:
            return 0
        time.sleep(args.interval)


def _scale(args: argparse.Namespace, overrides: list[str]) -> int:
    import os

    from phalanx import env
    from phalanx.cli_net import controller_of
    from phalanx.launch.options import parse_scale

    try:
        want = parse_scale(args.counts)
    except ValueError as e:
        raise SystemExit(f"phalanx scale: {e}") from None
    out: dict[str, dict[str, object]] = {}
    if args.kubeconfig:
        from phalanx.launch.k8s import scale_jobs

        scaled = scale_jobs(args.kubeconfig, args.namespace, args.release, want)
        out["kubernetes"] = {
            s.role: {"job": s.job, "namespace": s.namespace, "from": s.before, "to": s.after}
            for s in scaled
        }
        if not args.json:
            for s in scaled:
                print(f"{s.role}: Job {s.job} in {s.namespace}: {s.before} -> {s.after} pods")
    # With --kubeconfig the cluster starts and stops the pods; a controller named too
    # records the wanted count (status, /metrics). Without, the controller is the target.
    if not args.kubeconfig or args.controller or os.environ.get(env.CONTROLLER):
        desired = _scale_controller(controller_of(args, "scale"), want)
        out["desired"] = dict(desired)
        if not args.json:
            print("desired replicas: " + ", ".join(f"{k}={v}" for k, v in sorted(desired.items())))
    if args.json:
        print(json.dumps(out))
    return 0


def _scale_controller(controller: str, want: dict[str, int]) -> dict[str, int]:
    """Record the wanted counts in the controller (``phalanx run`` follows them)."""
    from phalanx.client import Transport
    from phalanx.console.poll import fetch_status
    from phalanx.protocol.commands import ScaleReply, ScaleReq

    roles = sorted(fetch_status(controller).roles)
    unknown = sorted(set(want) - set(roles))
    if unknown:
        raise SystemExit(
            f"phalanx scale: role must be one of this job's roles {roles}: got {unknown}."
        )
    t = Transport(controller, unreachable_timeout_s=10.0)
    desired: dict[str, int] = {}
    try:
        for role, n in want.items():
            desired = dict(t.call("/v1/scale", ScaleReq(role=role, replicas=n), ScaleReply).desired)
    finally:
        t.close()
    return desired


def _replica(args: argparse.Namespace, overrides: list[str]) -> int:
    import os

    from phalanx import env
    from phalanx.checkpoint import NoUsableCheckpoint
    from phalanx.client import CertificateMismatch
    from phalanx.config import load_config
    from phalanx.jobs import EXIT_UNRECOVERABLE, JobError, ReplicaArgs, spec_for
    from phalanx.log import setup
    from phalanx.net import AddressError
    from phalanx.train.base import BranchAbandoned

    setup()
    cfg = load_config(args.config, overrides)
    replica = ReplicaArgs(
        cfg=cfg,
        name=args.name or f"{args.role}-{os.getpid()}",
        controller=args.controller or os.environ.get(env.CONTROLLER),
        out=Path(args.out) if args.out else None,
        state=Path(args.state) if args.state else None,
        role=args.role,
    )
    try:
        return spec_for(replica).load()(replica)
    except (
        JobError,
        NoUsableCheckpoint,
        CertificateMismatch,
        AddressError,
    ) as e:  # a restart cannot help
        print(f"phalanx replica {replica.name}: {e}", file=sys.stderr, flush=True)
        return EXIT_UNRECOVERABLE
    except BranchAbandoned as e:  # a restart is the cure: it resumes from the root
        print(f"phalanx replica {replica.name}: {e}", file=sys.stderr, flush=True)
        return 1


def _run(args: argparse.Namespace, overrides: list[str]) -> int:
    from phalanx.cli_run import run

    return run(args, overrides)


def _syncer(args: argparse.Namespace, overrides: list[str]) -> int:
    from phalanx.config import load_config
    from phalanx.jobs import EXIT_UNRECOVERABLE, JOBS, JobError, ReplicaArgs
    from phalanx.log import setup

    setup()
    try:
        return JOBS["diloco_syncer"].load()(
            ReplicaArgs(load_config(args.config, overrides), "syncer")
        )
    except JobError as e:
        print(f"phalanx syncer: {e}", file=sys.stderr, flush=True)
        return EXIT_UNRECOVERABLE


def _ckpt(args: argparse.Namespace, overrides: list[str]) -> int:
    from phalanx.checkpoint.cli import run as run_ckpt

    return run_ckpt(args)


def build_parser() -> argparse.ArgumentParser:
    from phalanx.audit.cli import add_parser as add_audit_parser
    from phalanx.cli_agent import add_agent_parser, run_agent
    from phalanx.cli_net import add_advertise_host, add_ca_file, add_controller, add_tls
    from phalanx.launch.k8s import add_kubernetes

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
    add_tls(c)
    add_advertise_host(c)
    c.add_argument(
        "--fresh",
        action="store_true",
        help="if the state dir's journal is missing, empty or damaged, move it aside and begin "
        "the job again at epoch 1 (without it the controller refuses to start)",
    )
    c.set_defaults(fn=_controller)

    r = sub.add_parser(
        "replica",
        help="run one replica of a job and attach it to the job's controller",
        description="Run one replica. Extra --section.key VALUE arguments override the job config.",
    )
    r.add_argument("--config", help="job TOML file")
    add_controller(r)
    r.add_argument("--role", default="policy", choices=ROLES, help="role to join (default policy)")
    r.add_argument("--name", help="stable replica name (default ROLE-PID)")
    r.add_argument("--out", help="write the final model/optimizer state here (safetensors)")
    r.add_argument(
        "--state",
        help="RL policy replicas: checkpoint root (path or storage URL, shared by the job's "
        "policy replicas) the leader saves the committed state to (async DCP) before each "
        "ack, and every replica resumes from on restart",
    )
    r.set_defaults(fn=_replica)

    u = sub.add_parser(
        "run",
        help="run a whole job locally: controller + replicas, with live progress",
        description="Start the controller and the job's replicas as local processes and show "
        "progress. Extra --section.key VALUE arguments override the job config.",
    )
    u.add_argument("config", help="job TOML file")
    u.add_argument(
        "--replicas",
        help="replicas to start: N policy replicas (FT-DDP), or ROLE=N[,ROLE=N] such as "
        "policy=1,rollout=3 (default: each role's n_init_replicas)",
    )
    u.add_argument(
        "--chaos",
        help="faults to deliver, seeded and logged to RUN_DIR/chaos.jsonl: KIND=VALUE[,...] "
        "with kill-every=S (SIGKILL a replica; restart-after=S), stop-every=S (SIGSTOP a "
        "replica; stop-for=S), controller-kill-every=S, engine-kill-every=S (a rollout "
        "replica's engine), slow=REPLICA_OR_ROLE[:FRACTION] (slow-cycle=S), "
        "partition-every=S (a replica's packets dropped; partition-for=S; root, nftables), "
        "all-every=S (each fault's kind drawn among them all; slow-for=S), seed=N; e.g. "
        "kill-every=20,stop-every=30,seed=3 (see docs/operations.md)",
    )
    u.add_argument("--run-dir", help="where logs and state go (default runs/JOB-TIME)")
    u.add_argument("--plain", action="store_true", help="plain log lines instead of a live table")
    u.add_argument("--json", action="store_true", help="end with the summary as one JSON line")
    u.add_argument(
        "--no-zygote",
        action="store_true",
        help="start each replica as a fresh interpreter instead of forking it from a "
        "process that did the imports once",
    )
    u.add_argument(
        "--launcher",
        choices=["local", "ray"],
        default="local",
        help="where replicas run: local processes, or Ray actors (any job kind; the "
        "controller stays a local process, bound to the address the Ray nodes reach)",
    )
    u.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="--launcher ray: the cluster to join (HOST:PORT of its head, auto; default "
        "$RAY_ADDRESS, else a local instance sized for the replicas)",
    )
    u.add_argument(
        "--ray-cpus-per-rank",
        type=float,
        default=1.0,
        help="--launcher ray: CPUs each rank of a replica asks for (default 1)",
    )
    u.add_argument(
        "--ray-gpus-per-rank",
        type=float,
        default=0.0,
        help="--launcher ray: GPUs each rank of a replica asks for (default 0)",
    )
    u.add_argument(
        "--controllers",
        type=int,
        default=1,
        help="controllers of the job: more than 1 stand by for the leader and take over "
        "when it fails (needs --journal etcd or an etcd controller.journal)",
    )
    u.add_argument(
        "--journal",
        metavar="etcd|etcd://HOST:PORT[,...]",
        help="the controllers' journal in etcd: 'etcd' runs a local one in the run dir; a "
        "URL names yours (default: the config's controller.journal, SQLite)",
    )
    add_tls(u)
    add_ca_file(u)
    add_advertise_host(u)
    u.set_defaults(fn=_run)

    s = sub.add_parser(
        "status",
        help="show a job's status: rich tables, --watch to follow it live, or --json",
        description="Print a job's roles, replica counts and step; for an RL job also the "
        "prompt/rollout ledger and the latest reward and exact match.",
    )
    add_controller(s)
    s.add_argument(
        "--json",
        action="store_true",
        help="the full status as JSON (documented in docs/operations.md); with --watch, "
        "one JSON object per line",
    )
    s.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    s.add_argument(
        "--interval", type=float, default=1.0, help="seconds between refreshes (--watch)"
    )
    s.set_defaults(fn=_status)

    k = sub.add_parser(
        "scale",
        help="ask for a number of replicas per role (phalanx run, or Kubernetes)",
        description="Set the desired replica count of roles, e.g. `phalanx scale rollout=3`. "
        "The controller records it; a launcher that can start and stop replicas (phalanx "
        "run) starts new ones or stops the highest-numbered surplus ones. With --kubeconfig "
        "and --release, the Helm release's Indexed Job of each role is patched to N pods "
        "(parallelism and completions), and the controller, if named, records it too.",
    )
    k.add_argument("counts", nargs="+", metavar="ROLE=N", help="desired replicas of ROLE")
    add_controller(k)
    add_kubernetes(k)
    k.add_argument("--json", action="store_true", help="print the result as JSON")
    k.set_defaults(fn=_scale)

    add_agent_parser(sub, run_agent)
    add_audit_parser(sub)
    sy = sub.add_parser(
        "syncer",
        help='aggregate a decoupled DiLoCo job\'s rounds (diloco.aggregator = "syncer")',
        description="Average each round's pseudo-gradients in storage and write the result, so "
        "that the slots read one object per round instead of one per slot. It takes no part "
        "in training. Extra --section.key VALUE arguments override the job config.",
    )
    sy.add_argument("--config", required=True, help="the decoupled DiLoCo job's TOML")
    sy.set_defaults(fn=_syncer)
    ck = sub.add_parser(
        "ckpt",
        aliases=["checkpoint"],
        help="list, inspect, export and import checkpoints under a storage root",
        description="Look into a checkpoint root (a path or fsspec URL: file://, s3://, ...), "
        "export a checkpoint's model weights as plain safetensors or a Hugging Face "
        "directory, and import a Hugging Face directory as a checkpoint.",
    )
    ck_sub = ck.add_subparsers(dest="ckpt_command", required=True)
    ck_list = ck_sub.add_parser("list", help="committed checkpoints, oldest first")
    ck_inspect = ck_sub.add_parser(
        "inspect", help="one checkpoint: layout, files, sizes, tensors (shapes, dtypes)"
    )
    ck_inspect.add_argument("--verify", action="store_true", help="also check sizes and CRC32s")
    ck_export = ck_sub.add_parser(
        "export", help="write a checkpoint's model weights as one safetensors file"
    )
    ck_export.add_argument(
        "--format",
        required=True,
        help="output format: safetensors (one file) or hf (a from_pretrained directory)",
    )
    ck_export.add_argument(
        "--model-dir",
        help="hf: the model directory whose config and tokenizer to use (default: the job's)",
    )
    ck_export.add_argument(
        "--config",
        help="hf: the job's TOML, to rebuild its model from the spec (and merge a LoRA adapter)",
    )
    ck_export.add_argument(
        "--prefix", default="model", help="state subtree holding the weights (default model)"
    )
    for c_ in (ck_list, ck_inspect, ck_export):
        c_.add_argument("url", help="checkpoint root: a path or fsspec URL")
        c_.add_argument("--storage-options", help="fsspec options as JSON (e.g. an S3 endpoint)")
        if c_ is not ck_export:
            c_.add_argument("--json", action="store_true", help="print JSON")
        if c_ is not ck_list:
            c_.add_argument("--step", type=int, help="this step (default: the latest)")
    ck_export.add_argument("out", help="output file (safetensors) or directory (hf)")
    ck_import = ck_sub.add_parser(
        "import", help="a Hugging Face model directory as a model-only checkpoint (step 0)"
    )
    ck_import.add_argument("hf_dir", help="a save_pretrained directory of a causal LM")
    ck_import.add_argument("url", help="a new checkpoint root: a path or fsspec URL")
    ck_import.add_argument("--storage-options", help="fsspec options as JSON")
    ck.set_defaults(fn=_ckpt)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("controller", "replica", "run", "syncer", "agent"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from phalanx.cli_net import apply_env
    from phalanx.config import ConfigError

    apply_env(args, args.command)
    try:
        return args.fn(args, extra)
    except ConfigError as e:
        print(f"phalanx: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        from phalanx.client import ControllerError
        from phalanx.controller import CannotStart, Deposed, StateDirLocked

        if isinstance(e, StateDirLocked | CannotStart | Deposed | ControllerError | OSError):
            print(f"phalanx: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())

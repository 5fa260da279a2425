"""``phalanx run``: its options read and checked, then the launcher that fits the job.

Bad options end in one line (``SystemExit``) before anything starts.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    """``phalanx run``: the job's controllers and replicas on this machine (or its
    replicas as Ray actors), or a decoupled DiLoCo job's slots."""
    from phalanx.cli_net import run_controller_host, tls_files
    from phalanx.config import load_config
    from phalanx.launch.chaos.runner import check as check_chaos
    from phalanx.launch.local import LocalJob
    from phalanx.launch.options import Chaos, launch_counts

    if args.launcher == "local" and args.ray_address:
        raise SystemExit("phalanx run: --ray-address goes with --launcher ray: add it.")
    cfg = load_config(args.config, overrides)
    if cfg.diloco is not None and cfg.diloco.mode == "objectstore" and cfg.rl is None:
        from phalanx.launch.decoupled import DecoupledJob

        if args.launcher == "ray":  # the slots' executor (diloco.executor, ray_address)
            overrides = [*overrides, "--diloco.executor", "ray"]
            if args.ray_address:
                overrides += ["--diloco.ray_address", args.ray_address]
            cfg = load_config(args.config, overrides)

        if args.chaos or args.tls_cert or args.tls_key or args.journal or args.controllers != 1:
            raise SystemExit(
                "phalanx run: --chaos, --tls-cert/--tls-key, --controllers and --journal are "
                "for jobs with a controller; a decoupled DiLoCo job has none (it restarts "
                "failed slots itself: diloco.max_restarts). Drop them."
            )
        if args.replicas:
            if not args.replicas.isdigit() or int(args.replicas) < 1:
                raise SystemExit(
                    f"phalanx run: --replicas must be a positive count of slots for a decoupled "
                    f"DiLoCo job: got {args.replicas!r}."
                )
            overrides = [*overrides, "--diloco.replicas", args.replicas]
            cfg = load_config(args.config, overrides)
        run_dir = Path(args.run_dir or f"runs/{cfg.job.id}-{time.strftime('%Y%m%d-%H%M%S')}")
        return DecoupledJob(args.config, cfg, run_dir, overrides).run(as_json=args.json)
    check_model(cfg)
    try:
        chaos = Chaos.parse(args.chaos) if args.chaos else None
        counts, extra = launch_counts(cfg, args.replicas)
        if chaos is not None:
            check_chaos(chaos, cfg, counts, args.launcher)
    except ValueError as e:
        raise SystemExit(f"phalanx run: {e}") from None
    local_etcd, journal = controllers_of(args, cfg.controller.journal)
    extra += journal
    run_dir = Path(args.run_dir or f"runs/{cfg.job.id}-{time.strftime('%Y%m%d-%H%M%S')}")
    extra += standby_rollouts(args, cfg, run_dir)
    if extra:
        overrides = [*overrides, *extra]
        cfg = load_config(args.config, overrides)
    tls = tls_files(args, "run")
    host = run_controller_host(args, tls is not None)
    common = dict(
        controller_host=host, tls=tls, controllers=args.controllers, local_etcd=local_etcd
    )
    job: LocalJob
    if args.launcher == "ray":
        from phalanx.launch.ray_job import RayJob, RayOptions

        ray = RayOptions(args.ray_address, args.ray_cpus_per_rank, args.ray_gpus_per_rank)
        job = RayJob(args.config, cfg, run_dir, overrides, counts, chaos, ray=ray, **common)
    else:
        zygote = not args.no_zygote
        job = LocalJob(args.config, cfg, run_dir, overrides, counts, chaos, zygote, **common)
    code = job.run(live=not args.plain, as_json=args.json)
    if chaos is None:
        return code
    from phalanx.audit.cli import after_chaos  # a chaos run ends with its own audit

    return after_chaos(run_dir, code, args.json)


def check_model(cfg: Any) -> None:
    """What the job's model must fit that only the model says (``[replica] tp``: a
    tensor-parallel plan, heads and vocabulary that the degree divides; ``[lora]``:
    target modules that name some of its linear modules), refused in one line before
    any replica starts: each rank would say it, in a log, after loading the model."""
    from phalanx.config.model import ModelSection

    model = cfg.rl.model if cfg.rl is not None else cfg.train.model  # (an RL job: the policy's)
    if cfg.replica.tp > 1 and isinstance(model, ModelSection) and model.path is not None:
        from phalanx.train.tp_hf import TPError, check_dir

        try:
            check_dir(model.path, cfg.replica.tp)
        except TPError as e:
            raise SystemExit(f"phalanx run: {e}") from None
    if cfg.rl is not None and cfg.rl.env is not None:
        _check_env(cfg.rl.env)
    if cfg.rl is not None and cfg.rl.lora is not None:
        _check_lora(cfg.rl.model, cfg.rl.lora, "rl.lora", cfg.rl.task)
    elif cfg.train.lora is not None and isinstance(model, ModelSection) and model.path:
        _check_lora(model, cfg.train.lora, "train.lora")


def _check_env(section: Any) -> None:
    """``[rl.env]``'s environment built once here (its module imported, its factory run,
    its dataset read, the sandbox its tools need checked), so that a bad one is one
    line now rather than in every rollout replica's log."""
    from phalanx.rl.agentic.envs import EnvLoadError, load_env

    try:
        load_env(section)
    except EnvLoadError as e:
        raise SystemExit(f"phalanx run: {e}") from None


def _check_lora(spec: Any, lora: Any, key: str, task: Any = None) -> None:
    """The LoRA targets against the model's modules, built on the meta device (its
    config alone: no weights are read or allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from phalanx.rl.lora import check_targets

    try:
        if spec.path is not None:
            config = AutoConfig.from_pretrained(spec.path, local_files_only=True)
        else:
            from phalanx.rl.model import model_config
            from phalanx.rl.tokenizer import task_tokenizer

            config = model_config(spec, task_tokenizer(task))
        with torch.device("meta"):
            built = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError):
        return  # (the replica's own load says what is wrong with the model, in one line)
    try:
        check_targets(built, lora, key)
    except ValueError as e:
        raise SystemExit(f"phalanx run: {e}") from None


def controllers_of(args: argparse.Namespace, configured: str) -> tuple[bool, list[str]]:
    """``--controllers`` and ``--journal``, checked against the config's journal
    (``configured``): whether the launcher runs a local etcd, and the config override
    that names the journal given. Raises ``SystemExit`` in one line."""
    n, journal = args.controllers, args.journal
    if not 1 <= n <= 9:
        raise SystemExit(f"phalanx run: --controllers must be 1 to 9: got {n}.")
    local, override = False, []
    if journal == "etcd":
        local = True
    elif journal is not None and (
        journal == "sqlite" or journal.startswith(("etcd://", "etcds://"))
    ):
        override = [f"--controller.journal={journal}"]
        configured = journal
    elif journal is not None:
        raise SystemExit(
            f"phalanx run: --journal must be 'etcd' (a local etcd in the run dir), an "
            f"etcd://HOST:PORT[,HOST:PORT...] URL (etcds:// over TLS) or 'sqlite': got "
            f"{journal!r}."
        )
    if n > 1 and not local and configured == "sqlite":
        raise SystemExit(
            f"phalanx run: --controllers {n} needs the journal in etcd (the standbys follow "
            f"the leader's through it): add --journal etcd (a local etcd) or --journal "
            f"etcd://HOST:2379, or set controller.journal in the job config."
        )
    return local, override


def standby_rollouts(args: argparse.Namespace, cfg: Any, run_dir: Path) -> list[str]:
    """An RL job run with standby controllers keeps its rollouts outside the controller
    (a standby refuses to start otherwise: the leader's payload log would not survive
    a takeover). On this machine, where ``rl.transport.rollouts`` is the controller, they
    go to ``RUN_DIR/rollouts`` (a storage store every replica here reaches), said in a
    line; on Ray, whose actors may run on other nodes, that is refused in one line."""
    if args.controllers == 1 or cfg.rl is None or cfg.rl.transport.rollouts != "controller":
        return []
    if args.launcher == "ray":
        raise SystemExit(
            f"phalanx run: --controllers {args.controllers} with an RL job needs "
            f"rl.transport.rollouts outside the controller (a standby cannot take over the "
            f"leader's payload log): set it to a redis:// URL or a storage URL every node "
            f"reaches (s3://..., a shared file://)."
        )
    store = f"file://{(run_dir / 'rollouts').resolve()}"
    print(
        f"phalanx run: rollouts go to {store} (rl.transport.rollouts): standby "
        f"controllers cannot take over the leader's own store",
        file=sys.stderr,
        flush=True,
    )
    return [f"--rl.transport.rollouts={store}"]

"""One rank of a tensor-parallel policy replica that checkpoints and resumes in
any layout: what an elastic agent restarts with another number of workers.

Usage (each rank, under torchrun or any launcher that sets RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT)::

    python -m phalanx.jobs.tp_worker --ckpt URL --steps N --save-every K
        [--batch B] [--out FILE] [--controller C --name NAME] [--step-delay S]

- The replica's ranks are its tensor-parallel group: TP size = WORLD_SIZE.
  With WORLD_SIZE 1 (or unset) no process group is made at all.
- At start it resumes from the latest committed checkpoint under ``--ckpt``
  if there is one, resharding it to this TP size: parameters, AdamW state,
  step, RNG and data position. A checkpoint saved with another ``--batch``
  or data seed is refused (the run would see other data).
- It trains until step ``N`` (the total, not a count from the resume point)
  on synthetic data whose global batch depends only on the step, so a run
  resumed at another TP size computes the same numbers up to the order of
  float reductions. Every ``K`` steps it saves asynchronously.
- Rank 0 prints one JSON line per step on stdout::

      {"event": "step", "step": s, "loss": x, "world": W, "resumed_from": r}

  (``resumed_from`` is the checkpoint step it started from, or null), and a
  last line ``{"event": "done", "step": s, "reason": "finished" | "sigterm",
  "checkpoint": s, "world": W, "resumed_from": r}``.
- SIGTERM (to any rank) stops every rank at the same step boundary (the ranks
  agree each step with one tiny all-reduce); they checkpoint that step,
  print ``done`` with ``reason "sigterm"`` and exit 0. This is how an agent
  changes the layout: SIGTERM, restart with another WORLD_SIZE, reshard-load.
- ``--out FILE``: at the end rank 0 writes the gathered (full, unsharded)
  model and optimizer state as safetensors (:mod:`phalanx.train.snapshot`).
- ``--controller C --name NAME``: rank 0 registers with the controller (URL
  or state dir) as policy replica NAME, heartbeats with its step, and
  deregisters on exit, so the replica visibly leaves and rejoins.

Exit status: 0 when finished or stopped by SIGTERM; 2 for bad arguments or
environment; a failed collective or checkpoint raises (non-zero).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import signal
import sys
import time
from dataclasses import asdict
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from phalanx import log as plog
from phalanx.jobs.base import JobError, ReplicaArgs
from phalanx.jobs.common import emit
from phalanx.train import tp, tp_state

log = logging.getLogger("phalanx.jobs.tp_worker")

ENV_WORLD = "WORLD_SIZE"
"""torchrun's; the replica's TP size. RANK, MASTER_ADDR and MASTER_PORT are read
by torch.distributed's env:// rendezvous."""


class Stop:
    """Set by SIGTERM; read at each step boundary."""

    requested = False

    @classmethod
    def handler(cls, signum: int, frame: FrameType | None) -> None:
        cls.requested = True


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m phalanx.jobs.tp_worker",
        description="One rank of a tensor-parallel replica that resumes in any layout.",
    )
    ap.add_argument("--ckpt", required=True, help="checkpoint root (any fsspec URL)")
    ap.add_argument("--steps", type=int, required=True, help="train until this step")
    ap.add_argument("--save-every", type=int, required=True, help="async save every K steps")
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences per step)")
    ap.add_argument("--out", default="", help="rank 0 writes the gathered state here at the end")
    ap.add_argument("--controller", default="", help="controller URL or state dir")
    ap.add_argument("--name", default="", help="replica name at the controller")
    ap.add_argument("--step-delay", type=float, default=0.0, help="sleep per step (tests)")
    ap.add_argument("--keep-last", type=int, default=3, help="checkpoints to keep")
    ap.add_argument("--timeout", type=float, default=60.0, help="collective timeout (s)")
    args = ap.parse_args(argv)
    if args.steps < 0 or args.save_every < 1 or args.batch < 1:
        ap.error(
            f"--steps must be >= 0, --save-every and --batch >= 1: got {args.steps}, "
            f"{args.save_every}, {args.batch}."
        )
    if bool(args.controller) != bool(args.name):
        ap.error("--controller and --name go together: give both or neither.")
    return args


def agree_stop(distributed: bool) -> bool:
    """True on every rank if SIGTERM reached any rank. Collective."""
    if not distributed:
        return Stop.requested
    flag = torch.tensor([int(Stop.requested)], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def run(args: ReplicaArgs) -> int:
    """The worker on a job config: ``checkpoint.url`` (required), ``train.steps``,
    ``checkpoint.every_steps``, ``train.global_batch_size`` (sequences per step),
    ``train.step_delay_s``, ``checkpoint.keep_last``, ``timeouts.collective_s``."""
    cfg = args.cfg
    if not cfg.checkpoint.url:
        raise JobError(
            "a tensor-parallel worker must checkpoint: checkpoint.url is empty. Set "
            "[checkpoint] url in the job config."
        )
    opts = argparse.Namespace(
        ckpt=cfg.checkpoint.url,
        steps=cfg.train.steps,
        save_every=cfg.checkpoint.every_steps or max(1, cfg.train.steps),
        batch=cfg.train.global_batch_size,
        out=str(args.out or ""),
        controller=args.controller or "",
        name=args.name if args.controller else "",
        step_delay=cfg.train.step_delay_s,
        keep_last=cfg.checkpoint.keep_last,
        timeout=cfg.timeouts.collective_s,
    )
    signal.signal(signal.SIGTERM, Stop.handler)
    return train(opts)


def train(args: argparse.Namespace) -> int:
    """Train, checkpoint and resume as the module docstring says (``args`` as
    :func:`parse` makes them)."""
    from phalanx.checkpoint import Checkpointer

    torch.set_num_threads(1)
    world = int(os.environ.get(ENV_WORLD, "1"))
    distributed = world > 1
    if distributed:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank() if distributed else 0
    who = plog.Who(role="policy", replica_id=args.name or "tp", rank=rank)
    rlog = plog.ReplicaLogger(log, who)

    cfg = tp.TPConfig()
    model = tp.build_model(cfg, tp.make_mesh(1, world))
    opt = tp.make_optimizer(model)
    data = {"seed": cfg.seed, "batch": args.batch}
    ck = Checkpointer(args.ckpt, keep_last=args.keep_last, layout={"dp": 1, "tp": world})

    def state(step: int) -> dict[str, Any]:
        return {
            "model": tp_state.model_state(model),
            "optim": tp_state.optim_state(model, opt),
            "step": step,
            "data": {**data, "position": step},
            "rng": torch.get_rng_state(),
            "config": {k: v for k, v in asdict(cfg).items() if k != "dtype"},
        }

    step, resumed_from = 0, None
    res = ck.load(state(0))
    if res is not None:
        saved = {k: res.state["data"][k] for k in data}
        if saved != data:
            raise ValueError(
                f"checkpoint data must match this run's: got {saved} in {res.url}, expected "
                f"{data}. Resume with the same --batch, or use a fresh --ckpt root."
            )
        tp_state.load_optim_state(model, opt, res.state["optim"])
        torch.set_rng_state(res.state["rng"])
        step = resumed_from = int(res.state["step"])
        rlog.info("resumed from step %d (%s, saved by %s)", step, res.url, res.manifest.layout)

    client = None
    if args.controller and rank == 0:
        from phalanx.client import ControllerClient

        client = ControllerClient(args.controller, "policy", args.name, ranks=world, rank=rank)
        client.report_progress(step=step)
        client.start_heartbeat()
    base: dict[str, Any] = {"world": world, "resumed_from": resumed_from}
    if client is not None:
        base["replica_id"] = client.replica_id
    saved_step = resumed_from
    reason = "finished"
    try:
        while step < args.steps:
            if agree_stop(distributed):
                reason = "sigterm"
                rlog.info("SIGTERM: checkpointing step %d, then exiting", step)
                break
            step += 1
            who.step = step
            loss = tp.train_step(model, opt, tp.batch_for_step(cfg, step, args.batch))
            if client is not None:
                client.report_progress(step=step)
            if rank == 0:
                emit({"event": "step", "step": step, "loss": loss, **base})
            if step % args.save_every == 0:
                ck.save_async(step, state(step))
                saved_step = step
            if args.step_delay:
                time.sleep(args.step_delay)
        if saved_step != step:
            ck.save(step, state(step))
        ck.wait()
        if args.out:
            gathered = tp_state.gathered_state(model, opt)
            if rank == 0:
                from phalanx.train.snapshot import save_state

                save_state(args.out, {"step": step, **gathered})
        if rank == 0:
            emit({"event": "done", "step": step, "reason": reason, "checkpoint": step, **base})
    finally:
        ck.close()
        if client is not None:
            client.close(reason)
    if distributed:
        dist.destroy_process_group()
    return 0


def main(argv: list[str] | None = None) -> int:
    # Before the model is built and the checkpoint loaded (seconds), so that a
    # SIGTERM meanwhile is not lost: the ranks stop at their first step boundary.
    signal.signal(signal.SIGTERM, Stop.handler)
    args = parse(argv)
    plog.setup()
    return train(args)


if __name__ == "__main__":
    sys.exit(main())

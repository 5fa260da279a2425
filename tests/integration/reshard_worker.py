"""One rank of a tensor-parallel job for the reshard tests (started under
torchrun-style env: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT).

It builds :mod:`phalanx.train.tp`'s model on a ``(dp, tp)`` mesh, optionally
loads a checkpoint (resharding it to this layout) and dumps the gathered
state right after the load, trains ``--train`` steps, then optionally saves a
checkpoint and dumps the gathered state again. Dumps are safetensors files
written by rank 0 (:func:`phalanx.train.snapshot.save_state`), so the test
compares runs without pickle crossing a process boundary."""

from __future__ import annotations

import argparse
import datetime
import os

import torch
import torch.distributed as dist

from phalanx.checkpoint import Checkpointer
from phalanx.train import tp, tp_state
from phalanx.train.snapshot import save_state

PROBE_STEP = 10**6
"""The dumps record the loss on this step's batch, which no run trains on:
the same state must compute the same function in every layout."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--load", default="", help="checkpoint root to resume from")
    ap.add_argument("--dump-loaded", default="", help="gathered state after the load")
    ap.add_argument("--train", type=int, default=0, help="steps to train")
    ap.add_argument("--save", default="", help="checkpoint root to save to at the end")
    ap.add_argument("--dump", default="", help="gathered state at the end")
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank() if world > 1 else 0
    cfg = tp.TPConfig()
    model = tp.build_model(cfg, tp.make_mesh(args.dp, args.tp))
    opt = tp.make_optimizer(model)
    layout = {"dp": args.dp, "tp": args.tp}

    def state(step: int) -> dict[str, object]:
        return {
            "model": tp_state.model_state(model),
            "optim": tp_state.optim_state(model, opt),
            "step": step,
        }

    def dump(path: str, step: int) -> None:
        gathered = tp_state.gathered_state(model, opt)
        loss = tp.evaluate(model, tp.batch_for_step(cfg, PROBE_STEP, args.batch))
        if rank == 0:
            record = {"step": step, "layout": layout, "eval_loss": loss, **gathered}
            save_state(path, record)

    step = 0
    if args.load:
        ck = Checkpointer(args.load, layout=layout)
        res = ck.load(state(0))
        assert res is not None, f"no checkpoint under {args.load}"
        tp_state.load_optim_state(model, opt, res.state["optim"])
        step = int(res.state["step"])
        ck.close()
        if args.dump_loaded:
            dump(args.dump_loaded, step)
    for _ in range(args.train):
        step += 1
        tp.train_step(model, opt, tp.batch_for_step(cfg, step, args.batch))
    if args.save:
        ck = Checkpointer(args.save, layout=layout)
        ck.save(step, state(step))
        ck.close()
    if args.dump:
        dump(args.dump, step)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()

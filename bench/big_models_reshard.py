"""One checkpoint, any layout: a Hugging Face model's checkpoint saved under
DP x FSDP x TP loads bit-identical under other layouts (issue 37).

    python bench/big_models_reshard.py [--json] [--layers 2] [--hidden 64] [--steps 3]
                                       [--save 2x2x2] [--load 1x1x2,3x1x1,1x1x1]

A llama built from config (untied head, grouped key/value heads, float32)
trains ``--steps`` AdamW steps in the saving layout, then the saving
replica's ranks save a checkpoint through :class:`phalanx.checkpoint.Checkpointer`;
each loading layout loads it as the FT jobs resume (the model's DTensors
resharded in place by DCP, the optimizer's state whole then cut like its
parameters: :func:`phalanx.train.shards.checkpoint_to_local`). A layout is
``RxDxT``: R replicas of D x T ranks, FSDP over D and TP over T
(:func:`phalanx.train.tp_hf.parallelize`); ``1x1x1`` is one process without
torch.distributed. Every launch is one world of R x D x T gloo ranks started by
``python -m phalanx.launch.ranks``; the replicas sum their gradients shard by
shard, and only replica 0's ranks save, as in the job
(:func:`phalanx.jobs.common.save_checkpoint`).

Figures:

- ``reshard_s``: the whole round trip's wall time (the saving launch and every
  loading launch, process start included); ``load_s``: each loading layout's
  ``Checkpointer.load`` plus the cut of the optimizer state, on its slowest
  rank; ``save_s``: the save, on the slowest saving rank.
- ``reshard_bit_exact``: every model and optimizer tensor (AdamW's moments and
  steps) that each loading layout holds after its load, gathered whole, is
  ``torch.equal`` to the saving layout's, and the param groups are equal.

The same round trip, with other layouts, is the test
``tests/integration/test_checkpoint_reshard_hf.py``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT_S = 300.0
SEQ = 8
BATCH = 8
VOCAB = 96
PRELOAD = (
    "import sys, torch.distributed.tensor.parallel, torch.distributed.fsdp, transformers; "
    "import transformers.models.llama.modeling_llama, phalanx.checkpoint, phalanx.train.tp_hf; "
    "from phalanx.launch.ranks import main; sys.exit(main(sys.argv[1:]))"
)
RUN_SELF = "import runpy; runpy.run_path({path!r}, run_name='__main__')"


def parse_layout(text: str) -> tuple[int, int, int]:
    """``RxDxT`` -> (replicas, dp, tp)."""
    try:
        r, d, t = (int(x) for x in text.split("x"))
    except ValueError:
        raise ValueError(f"a layout must be RxDxT (replicas x FSDP x TP): got {text!r}") from None
    if min(r, d, t) < 1:
        raise ValueError(f"a layout's sizes must be >= 1: got {text!r}")
    return r, d, t


# -- one rank ---------------------------------------------------------------


def build_model(layers: int, hidden: int, seed: int) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4 * SEQ,
        tie_word_embeddings=False,
        attention_dropout=0.0,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32)


def gathered(model: Any, optimizer: Any) -> dict[str, Any]:
    """The whole model and optimizer state (a collective over the replica's ranks)."""
    import torch

    def full(t: torch.Tensor) -> torch.Tensor:
        g = t.full_tensor() if hasattr(t, "full_tensor") else t
        return g.detach().clone().cpu()

    osd = optimizer.state_dict()
    return {
        "model": {k: full(v) for k, v in model.state_dict().items()},
        "optimizer": {
            "state": {
                str(pid): {k: full(v) if isinstance(v, torch.Tensor) else v for k, v in st.items()}
                for pid, st in osd["state"].items()
            },
            "param_groups": osd["param_groups"],
        },
    }


def worker(args: argparse.Namespace) -> int:
    """One rank of a launch: build the layout, train or load, save, dump."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F  # noqa: N812

    from phalanx.checkpoint import Checkpointer
    from phalanx.train.shards import checkpoint_to_local, load_local, local
    from phalanx.train.snapshot import save_state
    from phalanx.train.tp_hf import parallelize

    torch.set_num_threads(1)
    replicas, dp, tp = parse_layout(args.layout)
    n = dp * tp
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != replicas * n:
        raise SystemExit(f"layout {args.layout} needs {replicas * n} ranks: got {world}")
    model = build_model(args.layers, args.hidden, seed=0)
    rank, replica, cross, group = 0, 0, None, None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        rank = dist.get_rank()
        replica = rank // n
        mesh = init_device_mesh("cpu", (replicas, dp, tp), mesh_dim_names=("replica", "dp", "tp"))
        groups = [dist.new_group(list(range(r * n, (r + 1) * n))) for r in range(replicas)]
        group = groups[replica]
        cross = mesh["replica"].get_group() if replicas > 1 else None
        if tp > 1:
            parallelize(model, mesh["tp"], mesh["dp"])
        elif dp > 1:
            from phalanx.train.shards import shard_model

            shard_model(model, mesh["dp"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    dp_rank = (rank % n) // tp

    for step in range(1, args.steps + 1):
        gen = torch.Generator().manual_seed(step)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        per = BATCH // (replicas * dp)
        mine = ids[(replica * dp + dp_rank) * per :][:per]
        logits = model(input_ids=mine).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), mine[:, 1:].reshape(-1), reduction="sum")
        (loss / (BATCH * (SEQ - 1))).backward()
        if cross is not None:  # the replicas sum each shard's gradient (HSDP)
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(local(p.grad), group=cross)
        optimizer.step()
        optimizer.zero_grad()

    out: dict[str, Any] = {"event": "done", "layout": args.layout}
    if args.load_url:
        ck = Checkpointer(args.load_url, group=group, layout={"layout": args.layout})
        t0 = time.perf_counter()
        res = ck.load({"model": model.state_dict()})
        if res is None:
            raise SystemExit(f"no checkpoint under {args.load_url}")
        load_local(model, optimizer, checkpoint_to_local(model, optimizer, res.state))
        out["load_s"] = time.perf_counter() - t0
        ck.close()
    if args.save_url and replica == 0:  # one replica's ranks save, as in the job
        ck = Checkpointer(args.save_url, group=group, layout={"layout": args.layout})
        t0 = time.perf_counter()
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        ck.save(args.steps, {**state, "step": args.steps})
        out["save_s"] = time.perf_counter() - t0
        ck.close()
    if args.dump and replica == 0:
        state = gathered(model, optimizer)
        if rank == 0:
            save_state(args.dump, state)
    if world > 1:
        # The slowest rank's times: a load or save ends when its last rank is done.
        keys = [k for k in ("load_s", "save_s") if k in out]
        if keys:
            t = torch.tensor([out[k] for k in keys], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            out.update(zip(keys, t.tolist(), strict=True))
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        print(json.dumps(out), flush=True)
    return 0


# -- the round trip ---------------------------------------------------------


def launch(layout: str, work: Path, extra: list[str]) -> dict[str, Any]:
    """One launch of ``layout``'s ranks; rank 0's ``done`` line. Raises with the
    launch's stderr tail when a rank fails."""
    r, d, t = parse_layout(layout)
    worker = ["--worker", "--layout", layout, *extra]
    cmd = [sys.executable, str(Path(__file__).resolve()), *worker]
    if r * d * t > 1:
        # The launcher imports what the ranks need, then forks them (--fork): one
        # interpreter's imports per launch, not one per rank, on a busy machine.
        rank = [sys.executable, "-c", RUN_SELF.format(path=str(Path(__file__).resolve()))]
        cmd = [sys.executable, "-c", PRELOAD, "--nproc", str(r * d * t), "--fork", "--", *rank]
        cmd += worker
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    err = work / f"{layout}.err"
    with err.open("wb") as fe:
        p = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=fe, env=env, start_new_session=True
        )
        try:
            stdout, _ = p.communicate(timeout=LAUNCH_TIMEOUT_S)
        finally:
            if p.poll() is None:  # its own process group: the launcher and its ranks
                os.killpg(p.pid, 9)
                p.wait()
    if p.returncode != 0:
        raise RuntimeError(f"layout {layout} failed ({p.returncode}): {err.read_text()[-3000:]}")
    lines = [json.loads(x) for x in stdout.decode().splitlines() if x.startswith("{")]
    return lines[-1]


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two state trees are not bit-identical (tensors: dtype, shape, bits)."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            return [f"{path}: {a.dtype} {list(a.shape)} vs {b.dtype} {list(b.shape)}"]
        return [] if torch.equal(a, b) else [f"{path}: values differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{path}/{k}: only on one side" for k in sorted(set(a) ^ set(b), key=str)]
        return out + [d for k in a if k in b for d in differences(a[k], b[k], f"{path}/{k}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y, f"{path}/{i}")
        ]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def reshard(
    save: str = "2x2x2",
    loads: tuple[str, ...] = ("1x1x2", "3x1x1", "1x1x1"),
    *,
    layers: int = 2,
    hidden: int = 64,
    steps: int = 3,
    work: Path | None = None,
) -> dict[str, Any]:
    """The round trip (module doc): save under ``save``, load under each of ``loads``.
    Returns the figures, with ``differences``: each load's first mismatches."""
    from phalanx.train.snapshot import load_state

    for layout in (save, *loads):
        parse_layout(layout)
    with tempfile.TemporaryDirectory(prefix="reshard-") as tmp:
        w = work or Path(tmp)
        url = f"file://{w}/ckpt"
        size = ["--layers", str(layers), "--hidden", str(hidden)]
        t0 = time.perf_counter()
        saved = launch(
            save,
            w,
            [*size, "--steps", str(steps), "--save-url", url, "--dump", str(w / "saved.st")],
        )
        loaded = {
            layout: launch(
                layout,
                w,
                [*size, "--steps", "0", "--load-url", url, "--dump", str(w / f"{layout}.st")],
            )
            for layout in loads
        }
        total = time.perf_counter() - t0
        ref = load_state(w / "saved.st")
        diffs = {layout: differences(ref, load_state(w / f"{layout}.st"))[:8] for layout in loads}
        tensors = sum(1 for k in ref["model"]) + sum(
            1 for st in ref["optimizer"]["state"].values() for v in st.values() if hasattr(v, "dim")
        )
    return {
        "save_layout": save,
        "load_layouts": list(loads),
        "reshard_s": round(total, 3),
        "save_s": round(saved["save_s"], 4),
        "load_s": {layout: round(x["load_s"], 4) for layout, x in loaded.items()},
        "tensors": tensors,
        "reshard_bit_exact": not any(diffs.values()),
        "differences": {k: v for k, v in diffs.items() if v},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--save", default="2x2x2", help="saving layout RxDxT (2x2x2)")
    p.add_argument("--load", default="1x1x2,3x1x1,1x1x1", help="loading layouts, comma-separated")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--steps", type=int, default=3, help="AdamW steps before the save")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--layout", default="1x1x1", help=argparse.SUPPRESS)
    p.add_argument("--load-url", dest="load_url", default="", help=argparse.SUPPRESS)
    p.add_argument("--save-url", dest="save_url", default="", help=argparse.SUPPRESS)
    p.add_argument("--dump", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    try:
        out = reshard(
            args.save,
            tuple(x for x in args.load.split(",") if x),
            layers=args.layers,
            hidden=args.hidden,
            steps=args.steps,
        )
    except ValueError as e:
        raise SystemExit(f"big_models_reshard: {e}") from None
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:18} {v}")
    return 0 if out["reshard_bit_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())

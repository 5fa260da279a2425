"""Tensor parallelism inside a fault-tolerant replica (``[replica] tp``, issue 37)
against plain DTensor TP over the same ranks, same model, same run.

    python bench/big_models_tp.py [--json] [--rounds 3] [--steps 12] [--hidden 256] [--layers 4]

The model is a Llama built from config (``examples/make_model.py --arch llama``:
``--hidden`` wide, ``--layers`` blocks, 4 heads, MLP 4 x hidden, tied embeddings,
random weights) trained on a generated corpus, 64 tokens per sample, float32,
AdamW, global batch 16 in micro-batches of 4, one torch thread per process.

- ``tp_step_s``: a real controller and one replica of ``--ranks`` ranks at
  ``tp = --tp`` (``phalanx replica`` under ``phalanx.launch.ranks``: the model's
  transformers TP plan through ``parallelize_module``, FSDP2 over ``ranks / tp``,
  the FT manager: quorum, commit vote, cross-replica all-reduce of its shards);
  the median gap between consecutive commits after ``--warmup`` steps.
- ``plain_step_s``: the same ranks, model, batch and micro-batches, parallelized by
  the same :func:`~phalanx.train.tp_hf.parallelize`, trained by a plain loop: no
  controller, no quorum, no vote, no cross-replica exchange.
- ``tp_step_ratio``: the first over the second (goal: at most 1.05).

The arms alternate (plain, FT, plain, FT, ... for ``--rounds`` rounds of
``--steps`` steps each), so that a change in the machine's load falls on both:
``tp_step_s`` and ``plain_step_s`` are the medians of the per-round medians, and
``*_spread`` the (min, max) of those; ``ratio_spread`` is the (min, max) of the
per-round ratios. ``load_avg`` is the 1-minute load average before and after:
on a shared machine, read the ratio with it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from hsdp import PY, Lines, env, median_gap, ranks_cmd  # noqa: E402

SEQ, BATCH, MICRO = 64, 16, 4
WORDS = ["def", "return", "self", "if", "else", "for", "in", "import", "class", "none", "x"]


def make_model(work: Path, hidden: int, layers: int) -> tuple[Path, Path]:
    """A Llama from config and its tokenizer (``examples/make_model.py``), and a corpus."""
    rng = random.Random(0)
    corpus = work / "corpus.jsonl"
    rows = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 120))) for _ in range(800))
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    model = work / "llama"
    cmd = [PY, str(HERE.parent / "examples" / "make_model.py"), str(model), "--arch", "llama"]
    cmd += ["--data", str(corpus), "--vocab", "512", "--hidden", str(hidden)]
    cmd += ["--layers", str(layers), "--heads", "4", "--kv-heads", "4"]
    cmd += ["--intermediate", str(4 * hidden), "--max-len", str(2 * SEQ)]
    subprocess.run(cmd, check=True, env=env(), capture_output=True, timeout=900)
    return model, corpus


def job_toml(path: Path, model: Path, corpus: Path, steps: int, ranks: int, tp: int) -> Path:
    path.write_text(
        f"""[job]
id = "bench-tp"
seed = 0
[timeouts]
collective_s = 10.0
heartbeat_s = 20.0
quorum_s = 120.0
heartbeat_interval_s = 0.5
[roles.policy]
min_replicas = 1
n_init_replicas = 1
join_timeout_s = 0.5
[replica]
ranks = {ranks}
tp = {tp}
[train]
steps = {steps}
global_batch_size = {BATCH}
micro_batch_size = {MICRO}
lr = 1e-3
threads = 1
[train.model]
path = "{model}"
[train.data]
path = "{corpus}"
kind = "pretrain"
seq_len = {SEQ}
cache_dir = "{path.parent / "cache"}"
"""
    )
    return path


def plain_worker(config: str, steps: int) -> int:
    """One rank of plain DTensor TP (x FSDP2 over ``ranks / tp``) with no fault
    tolerance: the baseline. The global batch is split over the data-parallel ranks
    as the FT replica splits its share; the leader prints a line per step."""
    import torch

    from phalanx.config import load_config
    from phalanx.jobs import task
    from phalanx.jobs.common import keep_freed_memory
    from phalanx.jobs.mlp import build_optimizer
    from phalanx.train.batch import micro_batches, split
    from phalanx.train.ranks import ReplicaRanks
    from phalanx.train.tp_hf import parallelize

    cfg = load_config(config)
    tc = cfg.train
    keep_freed_memory()  # as a phalanx replica does
    torch.set_num_threads(tc.threads)
    ranks = ReplicaRanks(120.0, tp=cfg.replica.tp)
    assert ranks.tp_mesh is not None
    job = task.build(
        tc,
        cfg.job.seed,
        torch.device("cpu"),
        always_forward=True,
        wrap=lambda m: parallelize(m, ranks.tp_mesh, ranks.mesh),  # type: ignore[arg-type]
    )
    model = job.model
    opt = build_optimizer(tc, model)
    batch = tc.global_batch_size
    for step in range(1, steps + 1):
        off, count = split(batch, ranks.dp_size, ranks.dp_rank)
        start = (step - 1) * batch + off
        idx = [i % job.dataset_size for i in range(start, start + count)]
        for p in model.parameters():
            p.grad = None
        for mb in micro_batches(idx, tc.micro_batch_size or batch):
            job.compute(mb, 1.0 / batch)
        opt.step()
        if ranks.leader:
            print(json.dumps({"event": "step", "step": step, "t": time.time()}), flush=True)
    ranks.close()
    return 0


def plain_arm(work: Path, cfg: Path, ranks: int, steps: int, warmup: int) -> float:
    """Plain TP over ``ranks`` ranks: the median gap between its steps after ``warmup``."""
    work.mkdir(parents=True, exist_ok=True)
    me = str(Path(__file__).resolve())
    base = Lines(ranks_cmd(ranks, me, "--plain-worker", str(cfg), str(steps)), work / "plain.err")
    base.wait(lambda e: e.get("step") == steps, "the plain TP baseline")
    base.p.wait()
    return median_gap(base.events, warmup, steps)


def ft_arm(work: Path, cfg: Path, ranks: int, steps: int, warmup: int) -> float:
    """A controller and one FT replica of ``ranks`` ranks: the median gap between its
    commits after ``warmup``. (A fresh ``work`` each round: a fresh job.)"""
    work.mkdir(parents=True, exist_ok=True)
    state = work / "state"
    ctl = Lines([PY, "-m", "phalanx.cli", "controller", "--config", str(cfg),
                 "--state-dir", str(state), "--port", "0"], work / "controller.err")  # fmt: skip
    rep = None
    try:
        deadline = time.monotonic() + 120
        while not (state / "url").exists():
            if time.monotonic() > deadline or ctl.p.poll() is not None:
                raise RuntimeError(f"the controller did not start: see {work / 'controller.err'}")
            time.sleep(0.1)
        cmd = ["-m", "phalanx.cli", "replica", "--config", str(cfg), "--controller", str(state)]
        rep = Lines(ranks_cmd(ranks, *cmd, "--name", "a"), work / "replica-a.err")
        rep.wait(lambda e: e["event"] == "done", "the FT replica", timeout=1800)
        return median_gap(rep.events, warmup, steps)
    finally:
        for p in (rep, ctl):
            if p is not None:
                p.kill()


def tp_step(
    work: Path | None = None,
    steps: int = 12,
    warmup: int = 3,
    hidden: int = 256,
    layers: int = 4,
    ranks: int = 2,
    tp: int = 2,
    rounds: int = 3,
) -> dict[str, Any]:
    """Both arms on the same model, batch and ranks, alternated over ``rounds``;
    ``tp_step_ratio`` (module doc)."""
    work = work or Path(tempfile.mkdtemp(prefix="bench-tp-"))
    model, corpus = make_model(work, hidden, layers)
    cfg = job_toml(work / "job.toml", model, corpus, steps, ranks, tp)
    load_before = os.getloadavg()[0]
    plain, ft = [], []
    for i in range(rounds):  # A B A B ...: the machine's load falls on both arms
        plain.append(plain_arm(work / f"plain-{i}", cfg, ranks, steps, warmup))
        ft.append(ft_arm(work / f"ft-{i}", cfg, ranks, steps, warmup))
    ratios = [f / b for f, b in zip(ft, plain, strict=True)]
    return {
        "hidden": hidden,
        "layers": layers,
        "ranks": ranks,
        "tp": tp,
        "steps": steps,
        "rounds": rounds,
        "tp_step_s": statistics.median(ft),
        "plain_step_s": statistics.median(plain),
        "tp_step_ratio": statistics.median(ft) / statistics.median(plain),
        "tp_step_spread": [min(ft), max(ft)],
        "plain_step_spread": [min(plain), max(plain)],
        "ratio_spread": [min(ratios), max(ratios)],
        "load_avg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--steps", type=int, default=12, help="steps per round and arm")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3, help="rounds of both arms, alternated")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--plain-worker", nargs=2, metavar=("CONFIG", "STEPS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.plain_worker:
        return plain_worker(args.plain_worker[0], int(args.plain_worker[1]))
    if not 0 < args.warmup < args.steps - 2:
        p.error(f"--warmup must be in (0, steps - 2): got {args.warmup} with --steps {args.steps}")
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1: got {args.rounds}")
    out = tp_step(
        None, args.steps, args.warmup, args.hidden, args.layers, args.ranks, args.tp, args.rounds
    )
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>17}  {v:.4g}" if isinstance(v, float) else f"{k:>17}  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

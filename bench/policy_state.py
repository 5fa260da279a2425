"""What keeping the RL policy's state durable costs a training step: the per-ack state
file it replaced against the async DCP checkpointer it uses now, in the same run.

    python bench/policy_state.py [--json] [--hidden 768] [--layers 12] [--repeats 3]

The state is what a policy replica saves at an ack point (``Manager.state_dict``):
a Qwen2 causal LM built from config (``--hidden``/``--layers``; the defaults give
about 160M parameters), AdamW's moments after one step, the step, the RNG state.

Figures (median over ``--repeats``):

- ``state_file_s``: ``save_state`` of the whole tree to one safetensors-framed file
  (pack, write, rename; no fsync), which the replica did before every ack: the
  step waited for all of it.
- ``async_stall_s``: what ``Checkpointer.save_async`` blocks the step for now (the
  copy of every tensor to host memory); ``stall_vs_file`` = async_stall_s /
  state_file_s.
- ``async_commit_s``: from that call until the save is committed (DCP write with
  CRC32s and fsync, manifest, ``latest``): the time the ack waits in the background
  while training goes on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def build_state(hidden: int, layers: int) -> tuple[dict[str, Any], int]:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from phalanx.train.manager import rng_state

    cfg = Qwen2Config(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    params = sum(p.numel() for p in model.parameters())
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": 1,
        "sampler": {},
        "rng": rng_state(),
        "extra": {},
    }
    return state, params


def measure(state: dict[str, Any], repeats: int, work: Path) -> dict[str, float]:
    from phalanx.checkpoint import Checkpointer
    from phalanx.train.snapshot import save_state

    file_s, stall_s, commit_s = [], [], []
    ckpt = Checkpointer(str(work / "ckpt"), keep_last=2)
    nbytes = 0
    for i in range(repeats):
        t0 = time.perf_counter()
        nbytes = save_state(work / "policy.state", state)
        file_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ckpt.save_async(i + 1, state)
        stall_s.append(time.perf_counter() - t0)
        ckpt.wait()
        commit_s.append(time.perf_counter() - t0)
    ckpt.close()
    f, s = statistics.median(file_s), statistics.median(stall_s)
    return {
        "state_mb": round(nbytes / 1e6, 1),
        "state_file_s": round(f, 3),
        "async_stall_s": round(s, 3),
        "async_commit_s": round(statistics.median(commit_s), 3),
        "stall_vs_file": round(s / f, 3),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    state, params = build_state(args.hidden, args.layers)
    with tempfile.TemporaryDirectory(dir="/tmp") as d:
        out = {"params": params, **measure(state, args.repeats, Path(d))}
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>16}  {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

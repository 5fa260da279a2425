"""vLLM over two tensor-parallel ranks against one: decode tokens per second.

    python bench/big_models_vllm.py [--json] [--prompts 8] [--n 8] [--prompt-len 16]
                                    [--new-tokens 32] [--repeats 3]

A Qwen2 causal LM built from config (random init, float32, seed 0: the ``large``
model of ``bench/engines.py``, hidden 768, 12 layers, 12 heads, ~100M
parameters) and written with ``save_pretrained``. Two ``VLLMEngine`` arms over
it, one after the other in the same run: ``tensor_parallel_size`` 1 (one worker,
in this process) and 2 (two worker processes, vLLM's ``mp`` executor). Each gets
the same ``--prompts`` prompts of ``--prompt-len`` random token ids, ``n = --n``
keyed samples each, ``--new-tokens`` new tokens, temperature 1; one untimed call
first, then ``--repeats`` timed calls; tokens/s = tokens generated / median
seconds. ``vllm_tp2_tokens_ratio`` = TP 2 / TP 1. No goal on CPU: on a host
whose cores are shared, the two ranks split the same cores; on GPU, each rank
is its own device. :func:`vllm_tp` returns the record (``bench/big_models.py``
assembles it with the other measurements).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from engines import EOS, build, timed


def vllm_tp(
    prompts: int = 8, n: int = 8, prompt_len: int = 16, new_tokens: int = 32, repeats: int = 3
) -> dict[str, Any]:
    """The TP 1 and TP 2 arms, measured in this process: ``tp1_tokens_per_s``,
    ``tp2_tokens_per_s`` and ``vllm_tp2_tokens_ratio``."""
    from phalanx.config.rl import EngineSection
    from phalanx.rl.engine.base import prompt_key
    from phalanx.rl.engine.vllm import VLLMEngine

    max_len = prompt_len + new_tokens + 16
    work = Path(tempfile.mkdtemp(prefix="phalanx-bench-vllm-tp-"))
    rec: dict[str, Any] = {"size": "large", "prompts": prompts, "n": n, "new_tokens": new_tokens}
    try:
        model = build("large", max_len, work / "large")
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(1)
        rows = torch.randint(3, vocab, (prompts, prompt_len), generator=g).tolist()
        keys = [prompt_key(0, i) for i in range(prompts)]
        state = model.state_dict()
        del model
        for tp in (1, 2):
            options = EngineSection(
                kind="vllm", dtype="float32", cpu_kv_cache_gib=1.0, tensor_parallel_size=tp
            )
            engine = VLLMEngine(work / "large", EOS, state, options, max_model_len=max_len)
            engine.version = 0
            try:

                def run(engine: VLLMEngine = engine) -> int:
                    comps = engine.generate(rows, n, new_tokens, 1.0, keys)
                    return sum(len(c.token_ids) for c in comps)

                seconds, tokens = timed(run, repeats)
            finally:
                engine.close()
            rec[f"tp{tp}_tokens_per_s"] = round(tokens / seconds, 1)
        rec["vllm_tp2_tokens_ratio"] = round(rec["tp2_tokens_per_s"] / rec["tp1_tokens_per_s"], 2)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    rec = vllm_tp(a.prompts, a.n, a.prompt_len, a.new_tokens, a.repeats)
    print(json.dumps(rec) if a.json else "  ".join(f"{k}={v}" for k, v in rec.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a weight update into vLLM goes: one ``VLLMEngine.load_weights`` of the
``large`` model of ``bench/engines.py`` (Qwen2, 97.6M parameters, 440 MB float32),
from tensors already in memory (no transfer), split into its phases.

    python bench/vllm_reload.py [--json] [--threads 2] [--repeats 3]

Each phase is timed by wrapping the function that does it (a stopwatch around
vLLM's own code, in this process only; nothing is replaced):

- ``staging_s``: our copy of each tensor into the engine's staging buffer (the
  next held copy, ``rl/engine/vllm_staging.py``); with one worker it runs inside
  vLLM's reload, which pulls the tensors through it;
- ``meta_s``: vLLM moving every layer's tensors to the meta device
  (``initialize_layerwise_reload``);
- ``materialize_s``: allocating each layer's tensors again (``materialize_layer``);
- ``repack_s``: the CPU backend's post-load processing of each linear layer
  (``dispatch_cpu_unquantized_gemm``: a oneDNN handle over a repacked copy of the
  weight, or a packed copy for small GEMMs);
- ``copy_back_s``: the processed tensors copied into the live ones
  (``_copy_and_restore_kernel_tensors``);
- ``loaders_s``: the buffered weight loaders' copies into the materialised
  tensors (fused qkv and gate-up slicing);
- ``load_s``: the rest of vLLM's reload (its ``load_weights``: name mapping,
  buffering each tensor until its layer is whole);
- ``finalize_s``: the attention layers' deferred processing;
- ``reload_s``: vLLM's whole ``reload_weights``; ``update_s``: our whole
  ``load_weights`` (checks, staging, reload, prefix cache dropped).

Medians of ``--repeats`` updates after one warm-up.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engines import EOS, build

TIMES: dict[str, float] = defaultdict(float)


def stopwatch(owner: Any, attr: str, phase: str) -> None:
    """Add the time of every call of ``owner.attr`` to ``TIMES[phase]``."""
    fn: Callable[..., Any] = getattr(owner, attr)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[phase] += time.perf_counter() - t0

    setattr(owner, attr, timed)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    from phalanx.config.rl import EngineSection
    from phalanx.rl.engine import vllm_staging
    from phalanx.rl.engine.vllm import VLLMEngine

    work = Path(tempfile.mkdtemp(prefix="phalanx-bench-reload-"))
    try:
        model = build("large", 64, work / "large")
        options = EngineSection(kind="vllm", dtype="float32", cpu_kv_cache_gib=1.0)
        engine = VLLMEngine(work / "large", EOS, model.state_dict(), options, max_model_len=64)
        from vllm.model_executor.layers import utils as layer_utils
        from vllm.model_executor.model_loader.reload import inplace, layerwise
        from vllm.v1.worker import gpu_model_runner

        stopwatch(vllm_staging.Staging, "put", "staging_s")
        stopwatch(inplace, "initialize_layerwise_reload", "meta_s")
        stopwatch(layerwise, "materialize_layer", "materialize_s")
        stopwatch(layer_utils, "dispatch_cpu_unquantized_gemm", "repack_s")
        stopwatch(layerwise, "_copy_and_restore_kernel_tensors", "copy_back_s")
        stopwatch(layerwise, "_layerwise_process", "layer_process_s")
        stopwatch(inplace, "finalize_layerwise_reload", "finalize_s")
        stopwatch(gpu_model_runner, "reload_weights", "reload_s")
        w = {k: v.detach().clone() for k, v in model.state_dict().items()}
        rows = []
        for v in range(a.repeats + 1):
            TIMES.clear()
            t0 = time.perf_counter()
            engine.load_weights(w, v + 1)
            TIMES["update_s"] = time.perf_counter() - t0
            rows.append(dict(TIMES))
        engine.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(r.get(k, 0.0) for r in rows[1:]) for k in rows[0]}
    # With one worker the staging copy runs inside vLLM's reload (it feeds it); each
    # layer's processing holds materialize, the loaders' copies, repack and copy-back.
    inner = med.pop("layer_process_s", 0.0)
    parts = ("materialize_s", "repack_s", "copy_back_s")
    med["loaders_s"] = inner - sum(med.get(k, 0.0) for k in parts)
    med["load_s"] = (
        med.get("reload_s", 0.0)
        - inner
        - med.get("staging_s", 0.0)
        - med.get("meta_s", 0.0)
        - med.get("finalize_s", 0.0)
    )
    rec = {"bytes": sum(t.numel() * t.element_size() for t in w.values())}
    rec |= {k: round(x, 4) for k, x in sorted(med.items())}
    print(json.dumps(rec) if a.json else "  ".join(f"{k}={x}" for k, x in rec.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""LoRA weight sync against full-model weight sync, on the same model.

    python bench/big_models_lora.py [--json] [--hidden 768] [--layers 12] [--rank 16]
                                    [--repeats 3] [--threads 2]

A llama causal LM built from config (random init, float32, seed 0): hidden
``--hidden``, ``--layers`` layers, hidden / 64 heads, MLP 8/3 x hidden, vocabulary
16384 (~100M parameters at the defaults), LoRA of rank ``--rank`` (alpha 2 x rank)
on q_proj, k_proj, v_proj and o_proj, as ``[rl.lora]`` would wrap it.

One sync, each arm: the policy side publishes its tensors to a storage weight store
(``transport/storage_weights.py``: safetensors and a manifest under a local
``file://`` directory, what ``rl.transport.weights = "file:///..."`` does), and the
rollout side fetches them (checksums verified), loads them into an HF engine and
generates one token with them:

- ``full``: the whole model's ``state_dict`` into an :class:`HFEngine`;
- ``lora``: the adapter's tensors (:func:`phalanx.rl.lora.adapter_state`) into a
  :class:`MergedLoraEngine`, which merges them into its base (W0 + (alpha / r) B A).

One untimed sync per arm first, then ``--repeats`` timed ones each, interleaved;
``lora_sync_s`` and ``full_sync_s`` are medians. ``lora_sync_ratio`` =
``lora_sync_s / full_sync_s`` (goal <= 0.5); ``lora_sync_bytes`` and
``full_sync_bytes`` are what each sync published.

``--json`` prints one JSON object: ``params``, ``lora_sync_ratio``,
``lora_sync_bytes``, ``full_sync_bytes``, ``lora_sync_s``, ``full_sync_s``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import torch


def _sync(store: Any, engine: Any, version: int, tensors: dict[str, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    store.publish(version, tensors)
    v, got = store.fetch(version)
    engine.load_weights(got, v)
    engine.generate([[1, 2, 3, 4]], 1, 1, temperature=0.0)
    return time.perf_counter() - t0


def lora_sync(
    hidden: int = 768, layers: int = 12, rank: int = 16, repeats: int = 3, threads: int = 2
) -> dict[str, Any]:
    """The figures of the module docstring for one model size and LoRA rank."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from phalanx.config.model import LoraSection
    from phalanx.rl.engine.hf import HFEngine
    from phalanx.rl.engine.lora import MergedLoraEngine
    from phalanx.rl.lora import adapter_state, apply_lora, nbytes
    from phalanx.transport.storage_weights import StorageWeightStore

    torch.set_num_threads(threads)
    cfg = LlamaConfig(
        vocab_size=16384,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )

    def build() -> Any:
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()

    spec = LoraSection(
        r=rank, alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    policy = apply_lora(build(), spec, 0)
    with torch.no_grad():  # a trained adapter: B != 0
        for p in policy.parameters():
            if p.requires_grad:
                p.normal_(std=0.01)
    adapter = {k: v.detach().clone() for k, v in adapter_state(policy).items()}
    full = {k: v.detach().clone() for k, v in policy.get_base_model().state_dict().items()}
    full = {k.replace(".base_layer.", "."): v for k, v in full.items() if ".lora_" not in k}
    params = sum(v.numel() for v in full.values())
    full_engine = HFEngine(build(), eos_id=0, pad_id=0, version=-1)
    lora_engine = MergedLoraEngine(apply_lora(build(), spec, 0), eos_id=0, pad_id=0, version=-1)
    times: dict[str, list[float]] = {"full": [], "lora": []}
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-lora-") as d:
        stores = {
            "full": StorageWeightStore(f"file://{d}/full", keep=1),
            "lora": StorageWeightStore(f"file://{d}/lora", keep=1),
        }
        engines, tensors = (
            {"full": full_engine, "lora": lora_engine},
            {"full": full, "lora": adapter},
        )
        for i in range(repeats + 1):
            for arm in ("full", "lora"):
                dt = _sync(stores[arm], engines[arm], i + 1, tensors[arm])
                if i:  # the first is a warm-up
                    times[arm].append(dt)
    lora_s, full_s = statistics.median(times["lora"]), statistics.median(times["full"])
    return {
        "params": params,
        "rank": rank,
        "lora_sync_ratio": round(lora_s / full_s, 4),
        "lora_sync_bytes": nbytes(adapter),
        "full_sync_bytes": nbytes(full),
        "lora_sync_s": round(lora_s, 4),
        "full_sync_s": round(full_s, 4),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    rec = lora_sync(a.hidden, a.layers, a.rank, a.repeats, a.threads)
    if a.json:
        print(json.dumps(rec), flush=True)
    else:
        for k, v in rec.items():
            print(f"{k:<18} {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

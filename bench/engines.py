"""Generation engines: vLLM against our HFEngine, and a weight update into vLLM
against the gloo broadcast that brings it, each against its baseline in the same run.

    python bench/engines.py [--json] [--sizes small,large] [--prompts 8] [--n 16]
                            [--prompt-len 16] [--new-tokens 32] [--threads 2] [--repeats 3]
                            [--bucket-mb 16] [--parts tokens,update,joiners]

**Tokens per second.** For each model size, a Qwen2 causal LM built from config
(random init, float32, seed 0) and written with ``save_pretrained``:

- ``small``: hidden 128, 4 layers, 4 heads (head size 32), vocabulary 8192: ~2M parameters;
- ``large``: hidden 768, 12 layers, 12 heads (64), MLP 2048, vocabulary 16384: ~100M.

Both engines get the same ``--prompts`` prompts of ``--prompt-len`` random token
ids, ``n = --n`` samples each, ``--new-tokens`` new tokens, temperature 1, keyed
sampling, on ``--threads`` torch threads. One untimed call first (warm-up), then
``--repeats`` timed calls; ``*_tokens_per_s`` = tokens generated / median seconds.
``vllm_over_hf`` = the ratio (goal at ``large``: >= 2).

**Weight update.** At the largest size: a sender process (this script with
``--sender``, rank 0, which loads the saved model and packs its state) and this
process (rank 1) form a gloo group over a ``TCPStore``, as a weight sync does
(``transport/collective.py``'s flat buffer). ``broadcast_s``: the median time of
a broadcast of all the model's bytes. Two ways of loading them, both in the run:

- sequential (``weight_update_s_sequential``, ``weight_update_ratio_sequential``:
  the figure before the overlap): from the bytes received to the engine
  generating with them: the received bytes' copy into a fresh buffer (the product's
  channel receives each sync into a fresh one: its page faults are part of every
  arm's cost, as the overlapped arm pays them while receiving), split the buffer
  into tensors, ``VLLMEngine.load_weights``
  (checks, staging copy, in-place reload, prefix cache dropped), and one 1-token
  generation, over ``broadcast_s``;
- overlapped (``weight_update_s``, ``weight_update_ratio``, goal <= 1.5): the
  bytes come in ``--bucket-mb`` buckets (``transport/streamed.py``) on a receiver
  thread, into a fresh buffer per update as the product's channel receives them,
  while ``load_weights`` reloads each tensor whose bytes are in; the stream is
  ``Owned`` (as ``jobs/rl_rollout.py`` hands it over), so the engine keeps the
  received tensors as its rollback copy with no staging memcpy.
  ``overlapped_total_s`` is the median of receive + reload + 1-token generation;
  ``weight_update_s`` = ``overlapped_total_s - broadcast_s``, the time the update
  costs beyond the transfer (the same quantity as the sequential figure), and
  ``weight_update_ratio`` = ``weight_update_s / broadcast_s``;
- without a rollback copy (``weight_update_s_no_rollback_copy``,
  ``weight_update_ratio_no_rollback_copy``): a second engine with
  ``rl.engine.rollback_copy = false``, fed as a replica then feeds it (whole
  buffer first, then ``load_weights``: no staging memcpy, no overlap), timed as
  the sequential arm.

**Joiner from a rollout peer or the policy leader** (``joiner_from_rollout_s``,
``joiner_from_policy_s``, ``joiner_policy_over_rollout``): at the largest size, the
time a late rollout replica waits for its weights when a rollout peer relays
them against when the training policy leader sends them at its next step
boundary (``bench/weight_joiners.py`` says how).

``--json`` prints one JSON object per line: per size ``params``,
``hf_tokens_per_s``, ``vllm_tokens_per_s``, ``vllm_over_hf``; once
``weight_update_s``, ``broadcast_s``, ``weight_update_ratio`` and the
fields above,
``joiner_from_rollout_s``, ``joiner_from_policy_s``, ``joiner_policy_over_rollout``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from weight_joiners import joiner_times

SIZES: dict[str, dict[str, int]] = {
    "small": dict(
        hidden_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=512,
        vocab_size=8192,
    ),
    "large": dict(
        hidden_size=768,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        intermediate_size=2048,
        vocab_size=16384,
    ),
}
EOS, PAD = 2, 0


def build(size: str, max_len: int, out: Path) -> Any:
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        **SIZES[size],
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
        eos_token_id=EOS,
        bos_token_id=1,
        pad_token_id=PAD,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model.save_pretrained(out)
    return model.eval()


def timed(fn: Any, repeats: int) -> tuple[float, Any]:
    fn()  # warm-up
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def sender(store: str, model_dir: str, repeats: int, bucket: int) -> int:
    """Rank 0 of the weight-update runs: the saved model's bytes, ``repeats + 1`` times
    whole (the baseline, then the sequential reload), then ``repeats + 1`` times in
    buckets (the overlapped reload), then ``repeats + 1`` times whole (the engine
    without a rollback copy)."""
    from transformers import AutoModelForCausalLM

    from phalanx.comm.torch_pg import TorchCommunicator
    from phalanx.transport.collective import pack
    from phalanx.transport.streamed import send_buckets

    flat = pack(AutoModelForCausalLM.from_pretrained(model_dir).state_dict())
    comm = TorchCommunicator(120.0)
    comm.configure(store, "bench/engines", 0, 2)
    for _ in range(repeats + 1):
        comm.broadcast(flat, 0)
    for _ in range(repeats + 1):
        send_buckets(comm, flat, bucket)
    for _ in range(repeats + 1):
        comm.broadcast(flat, 0)
    comm.abort()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sizes", default="small,large")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bucket-mb", type=float, default=16.0)
    ap.add_argument("--parts", default="tokens,update,joiners", help="what to measure")
    ap.add_argument("--sender", nargs=3, metavar=("STORE", "MODEL_DIR", "REPEATS"))
    a = ap.parse_args()
    bucket = max(1, int(a.bucket_mb * (1 << 20)))
    if a.sender:
        return sender(a.sender[0], a.sender[1], int(a.sender[2]), bucket)
    sizes = [s for s in a.sizes.split(",") if s]
    bad = [s for s in sizes if s not in SIZES]
    if bad or not sizes:
        print(f"--sizes must name some of {sorted(SIZES)}: got {a.sizes!r}.")
        return 2
    torch.set_num_threads(a.threads)

    from phalanx.config.rl import EngineSection
    from phalanx.rl.engine.base import prompt_key
    from phalanx.rl.engine.hf import HFEngine
    from phalanx.rl.engine.vllm import VLLMEngine

    def say(rec: dict[str, Any]) -> None:
        if a.json:
            print(json.dumps(rec), flush=True)
        else:
            print("  ".join(f"{k}={v}" for k, v in rec.items()), flush=True)

    max_len = a.prompt_len + a.new_tokens + 16
    g = torch.Generator().manual_seed(1)
    work = Path(tempfile.mkdtemp(prefix="phalanx-bench-engines-"))
    engine = model = None
    try:
        for size in sizes:
            d = work / size
            model = build(size, max_len, d)
            vocab = SIZES[size]["vocab_size"]
            prompts = torch.randint(3, vocab, (a.prompts, a.prompt_len), generator=g).tolist()
            keys = [prompt_key(0, i) for i in range(a.prompts)]

            def run(eng: Any, prompts: list[list[int]] = prompts, keys: list[int] = keys) -> int:
                comps = eng.generate(prompts, a.n, a.new_tokens, 1.0, keys)
                return sum(len(c.token_ids) for c in comps)

            options = EngineSection(kind="vllm", dtype="float32", cpu_kv_cache_gib=2.0)
            if engine is not None:
                engine.close()
            engine = VLLMEngine(d, EOS, model.state_dict(), options, max_model_len=max_len)
            engine.version = 0
            if "tokens" not in a.parts:
                continue
            hf = HFEngine(model, EOS, PAD)
            hf_s, hf_tokens = timed(lambda hf=hf: run(hf), a.repeats)
            v_s, v_tokens = timed(lambda engine=engine: run(engine), a.repeats)
            params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
            say(
                {
                    "size": size,
                    "params": params,
                    "hf_tokens_per_s": round(hf_tokens / hf_s, 1),
                    "vllm_tokens_per_s": round(v_tokens / v_s, 1),
                    "vllm_over_hf": round((v_tokens / v_s) / (hf_tokens / hf_s), 2),
                    "tokens": [hf_tokens, v_tokens],
                }
            )
        assert engine is not None and model is not None
        rec: dict[str, Any] = {}
        if "update" in a.parts:

            def remake(rollback_copy: bool) -> Any:
                opts = options.model_copy(update={"rollback_copy": rollback_copy})
                return VLLMEngine(d, EOS, model.state_dict(), opts, max_model_len=max_len)

            rec = weight_update(engine, remake, d, prompts[0], a.repeats, bucket)
        engine.close()  # (weight_update closed it: its last engine had no rollback copy)
        engine = None  # its memory and threads: the joiner sources train and send next
        if "joiners" in a.parts:
            rec |= joiner_times(work / sizes[-1], model.state_dict(), a.repeats)
        if rec:
            say(rec)
    finally:
        if engine is not None:
            engine.close()
        shutil.rmtree(work, ignore_errors=True)
    return 0


def weight_update(
    engine: Any, remake: Any, model_dir: Path, prompt: list[int], repeats: int, bucket: int
) -> dict[str, Any]:
    """The update arms (the module docstring); ``remake(rollback_copy)`` builds the
    engine again with that setting (the last arm's)."""
    from phalanx.comm.torch_pg import TorchCommunicator, serve_store
    from phalanx.rl.engine.base import Owned
    from phalanx.transport.streamed import receive_stream, unpack

    like = engine.layout()
    nbytes = sum(t.numel() * t.element_size() for t in like.values())
    store, addr = serve_store()
    proc = subprocess.Popen(
        [sys.executable, __file__, "--sender", addr, str(model_dir), str(repeats)],
        start_new_session=True,
    )
    comm = TorchCommunicator(120.0)
    try:
        comm.configure(addr, "bench/engines", 1, 2)
        flat = torch.empty(nbytes, dtype=torch.uint8)
        comm.broadcast(flat, 0)  # warm-up
        bcast, sequential = [], []
        for i in range(repeats):
            t0 = time.perf_counter()
            comm.broadcast(flat, 0)
            bcast.append(time.perf_counter() - t0)
            fresh = torch.empty(nbytes, dtype=torch.uint8)
            t0 = time.perf_counter()
            fresh.copy_(flat)  # the receive into a fresh buffer's page faults, timed
            engine.load_weights(unpack(fresh, like), i + 1)
            engine.generate([prompt], 1, 1, 1.0)
            sequential.append(time.perf_counter() - t0)
        overlapped = []
        for i in range(repeats + 1):  # the first is a warm-up
            # As the product's channel does: a fresh receive buffer per sync, which
            # nobody writes again (Owned: the engine keeps it as its rollback copy).
            t0 = time.perf_counter()
            fresh = torch.empty(nbytes, dtype=torch.uint8)
            stream = receive_stream(comm, fresh, like, bucket)
            engine.load_weights(Owned(stream), repeats + i + 1)
            engine.generate([prompt], 1, 1, 1.0)
            overlapped.append(time.perf_counter() - t0)
        # The engine without a rollback copy: fetched whole (as a replica then does),
        # each tensor straight into vLLM, no staging memcpy.
        engine.close()
        engine = remake(False)
        bare = []
        for i in range(repeats + 1):  # the first is a warm-up
            comm.broadcast(flat, 0)
            fresh = torch.empty(nbytes, dtype=torch.uint8)
            t0 = time.perf_counter()
            fresh.copy_(flat)  # as in the sequential arm
            engine.load_weights(unpack(fresh, like), 2 * repeats + i + 2)
            engine.generate([prompt], 1, 1, 1.0)
            bare.append(time.perf_counter() - t0)
        engine.close()
        proc.wait(timeout=120)
    finally:
        comm.abort()
        if proc.poll() is None:
            proc.kill()
        del store
    b, u = statistics.median(bcast), statistics.median(sequential)
    whole = statistics.median(overlapped[1:])
    return {
        "bytes": nbytes,
        "tensor_parallel_size": engine.tensor_parallel_size,
        "bucket_bytes": bucket,
        "broadcast_s": round(b, 4),
        "weight_update_s": round(whole - b, 4),
        "weight_update_ratio": round((whole - b) / b, 2),
        "overlapped_total_s": round(whole, 4),
        "weight_update_s_sequential": round(u, 4),
        "weight_update_ratio_sequential": round(u / b, 2),
        "weight_update_s_no_rollback_copy": round(statistics.median(bare[1:]), 4),
        "weight_update_ratio_no_rollback_copy": round(statistics.median(bare[1:]) / b, 2),
    }


if __name__ == "__main__":
    sys.exit(main())

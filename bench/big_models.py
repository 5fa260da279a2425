"""Models bigger than a device, in one run: tensor parallelism inside a
fault-tolerant replica, LoRA weight sync, vLLM across several ranks, the
in-place weight update, and the universal checkpoint's reshard round trip.

    python bench/big_models.py [--json] [--parts tp,lora,vllm,update,reshard]

Each part is its own benchmark, run here in a subprocess of its own (the TP
arms start process groups, the vLLM arms start engine workers: nothing of one
part's is left in the next's process), each comparing against its baseline in
the same run:

- ``tp`` (``bench/big_models_tp.py``): ``tp_step_ratio``, the FT replica's step
  (``[replica] ranks = 2, tp = 2``) / a plain DTensor TP loop over the same ranks,
  model and batch without fault tolerance. Goal <= 1.05.
- ``lora`` (``bench/big_models_lora.py``): ``lora_sync_ratio``, a LoRA weight
  sync (rank 16, to the engine generating with it) / the full model's sync, for
  the same ~100M model; ``lora_sync_bytes`` and ``full_sync_bytes``. Goal <= 0.5.
- ``vllm`` (``bench/big_models_vllm.py``): ``vllm_tp2_tokens_ratio``, vLLM at
  ``tensor_parallel_size = 2`` / 1, tokens per second. Reported, no goal on CPU
  (the two ranks share the same cores and add an all-reduce per layer).
- ``update`` (``bench/engines.py --parts update``): ``weight_update_ratio``, the
  overlapped in-place update of a vLLM engine beyond a gloo broadcast of the
  same 440 MB / the broadcast. Goal <= 1.5.
- ``reshard`` (``bench/big_models_reshard.py``): ``reshard_s``, the round trip
  of a checkpoint saved at 2 x (FSDP 2 x TP 2) and loaded at 1 x (TP 2), 3 x 1
  and a single process, and ``reshard_bit_exact``.

``--json`` prints one JSON object with those keys (and each part's own figures
under its name); otherwise a table of the headline figures against their goals.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent

PARTS: dict[str, list[str]] = {
    "tp": ["big_models_tp.py", "--json"],
    "lora": ["big_models_lora.py", "--json"],
    "vllm": ["big_models_vllm.py", "--json"],
    "update": ["engines.py", "--json", "--sizes", "large", "--parts", "update"],
    "reshard": ["big_models_reshard.py", "--json"],
}

HEADLINES: dict[str, list[tuple[str, str]]] = {
    "tp": [("tp_step_ratio", "<= 1.05")],
    "lora": [("lora_sync_ratio", "<= 0.5"), ("lora_sync_bytes", ""), ("full_sync_bytes", "")],
    "vllm": [("vllm_tp2_tokens_ratio", "reported")],
    "update": [("weight_update_ratio", "<= 1.5")],
    "reshard": [("reshard_s", ""), ("reshard_bit_exact", "true")],
}


def last_json(out: str) -> dict[str, Any]:
    """The last line of ``out`` that is a JSON object (a part may log before it)."""
    for line in reversed(out.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    raise ValueError("no JSON object in its output")


def run_part(name: str) -> dict[str, Any]:
    """One part's figures (its ``--json`` object), or ``{"error": ...}`` in one line."""
    script, *args = PARTS[name]
    cmd = [sys.executable, str(HERE / script), *args]
    print(f"# {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
    if done.returncode:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"error": f"exited with status {done.returncode}: {tail}"}
    try:
        return last_json(done.stdout)
    except ValueError as e:
        return {"error": str(e)}


def flatten(name: str, figures: dict[str, Any]) -> dict[str, Any]:
    """The part's headline keys at the top level (the whole part under its name):
    ``engines.py`` nests its figures by model size."""
    if name == "update" and "large" in figures and isinstance(figures["large"], dict):
        figures = {**figures["large"], **{k: v for k, v in figures.items() if k != "large"}}
    return {k: figures[k] for k, _ in HEADLINES[name] if k in figures}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"among {list(PARTS)}")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"big_models.py: --parts must be among {list(PARTS)}: got {unknown}.")
    out: dict[str, Any] = {}
    for name in parts:
        figures = run_part(name)
        out[name] = figures
        out.update(flatten(name, figures))
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{'figure':<26}{'value':>16}  goal")
    for name in parts:
        if "error" in out[name]:
            print(f"{name:<26}{'failed':>16}  {out[name]['error']}")
            continue
        for key, goal in HEADLINES[name]:
            print(f"{key:<26}{out.get(key, '-')!s:>16}  {goal}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

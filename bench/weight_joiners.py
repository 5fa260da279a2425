"""How long a late rollout replica waits for its weights: relayed by a rollout peer
against sent by the policy leader, in the same run (``bench/engines.py`` prints it).

    python bench/weight_joiners.py MODEL_DIR [--repeats 3] [--json]

Both sources are a real process with a real :class:`CollectiveWeightChannel` and
the model of ``MODEL_DIR`` (a ``save_pretrained`` causal LM); the joiner is this
process, on one torch thread, and each source trains or idles on one thread:

- **policy leader** (``joiner_from_policy_s``): it trains the model (AdamW, a
  batch of 4 sequences of 64 random tokens per step) and serves a sync order as
  the policy replica does (``jobs/rl_policy.py``'s ``Leader``): at its next step
  boundary it snapshots the weights (``pack``) and sends them from the channel's
  thread while it trains on.
- **rollout peer** (``joiner_from_rollout_s``): it holds the version it fetched
  last (the channel's kept buffer, set here as a fetch leaves it), idle between
  two generation batches as the controller requires of a source, and relays it
  at once.

The time is from the order reaching the source (a line on its stdin; the
controller's long-poll reply in a job) to the joiner holding every tensor, a new
mesh each time (a joiner always builds one): rendezvous, header and buffer.
Loading into the engine comes after and is the same either way
(``weight_update_s``). The median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch


def source(kind: str, model_dir: str) -> int:
    """A source process: prints its rendezvous address, then serves one order per
    stdin line ``MESH_ID`` (the joiner is rank 1), until stdin closes."""
    from transformers import AutoModelForCausalLM

    from phalanx.comm.torch_pg import serve_store
    from phalanx.transport.base import SyncOrder
    from phalanx.transport.collective import CollectiveWeightChannel, fingerprint, pack

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = model.state_dict()
    channel = CollectiveWeightChannel(300.0)
    _store, addr = serve_store()
    orders: list[int] = []
    lock = threading.Lock()

    def read() -> None:
        for line in sys.stdin:
            with lock:
                orders.append(int(line))
        with lock:
            orders.append(-1)

    def order(mesh_id: int) -> SyncOrder:
        return SyncOrder(
            seq=mesh_id, mesh_id=mesh_id, members=("src:1", "joiner:1"), rank=0, store=addr
        )

    threading.Thread(target=read, daemon=True).start()
    print(addr, flush=True)
    if kind == "rollout":
        channel.kept = (1, fingerprint(state), pack(state))
        while True:
            with lock:
                mesh = orders.pop(0) if orders else None
            if mesh == -1:
                break
            if mesh is None:
                time.sleep(0.001)  # idle between two generation batches
                continue
            channel.relay(order(mesh), 1)
    else:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
        vocab = model.config.vocab_size
        batch = torch.randint(3, vocab, (4, 64), generator=torch.Generator().manual_seed(0))
        step = 0
        while True:
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            with lock:  # the step boundary: serve an order that came during the step
                mesh = orders.pop(0) if orders else None
            if mesh == -1:
                break
            if mesh is not None:
                channel.publish(step, model.state_dict(), order(mesh), lambda res: None)
        if channel.pending is not None:
            channel.pending.result(300)
    channel.close()
    return 0


def joiner_times(model_dir: Path, like: dict[str, torch.Tensor], repeats: int) -> dict[str, Any]:
    """Median seconds for a joiner to get its weights from each source kind."""
    from phalanx.transport.base import SyncOrder
    from phalanx.transport.collective import CollectiveWeightChannel

    out: dict[str, Any] = {}
    for kind in ("rollout", "policy"):
        proc = subprocess.Popen(
            [sys.executable, __file__, "--source", kind, str(model_dir)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert proc.stdin is not None and proc.stdout is not None
        try:
            addr = proc.stdout.readline().strip()
            if not addr:
                raise RuntimeError(f"the {kind} source exited with {proc.wait()}")
            times = []
            for mesh in range(1, repeats + 2):  # the first one warms up
                ch = CollectiveWeightChannel(300.0)
                o = SyncOrder(
                    seq=mesh, mesh_id=mesh, members=("src:1", "joiner:1"), rank=1, store=addr
                )
                t0 = time.perf_counter()
                proc.stdin.write(f"{mesh}\n")
                proc.stdin.flush()
                ch.fetch(o, like)
                times.append(time.perf_counter() - t0)
                ch.close()
            proc.stdin.close()
            proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
        out[f"joiner_from_{kind}_s"] = round(statistics.median(times[1:]), 4)
    out["joiner_policy_over_rollout"] = round(
        out["joiner_from_policy_s"] / out["joiner_from_rollout_s"], 2
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--source", choices=("policy", "rollout"))
    a = ap.parse_args()
    if a.source:
        return source(a.source, str(a.model_dir))
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32)
    rec = joiner_times(a.model_dir, model.state_dict(), a.repeats)
    print(json.dumps(rec) if a.json else "  ".join(f"{k}={v}" for k, v in rec.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Loopback baseline of ``bench/rl.py``: a plain ``torch.distributed`` gloo broadcast
of the weight-sync's byte count among the weight-sync's process count, on this
machine, measured the way the policy leader times a sync.

One sync of :class:`phalanx.transport.collective.CollectiveWeightChannel` is two
broadcasts from rank 0: a 3 x int64 header, then the packed weights as one flat
uint8 buffer, which each receiver allocates afresh. Each repetition here does the
same after a barrier (so that, unlike a real sync, no rank waits for a late
peer): the time from the barrier to the end of the second broadcast, on each rank.

Processes: the caller serves the ``TCPStore`` on 127.0.0.1 (port 0) and starts
``world`` processes with multiprocessing's spawn, giving each only plain start
arguments (ints and a path); each writes its timings to ``DIR/rank{r}.json``.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

WARMUP = 20
"""Repetitions left out (the first broadcasts connect the gloo pairs)."""
TIMEOUT_S = 120.0


def loopback_worker(rank: int, world: int, port: int, nbytes: int, reps: int, out: str) -> None:
    """One rank: ``WARMUP + reps`` barrier-then-broadcast rounds; its times to ``out``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    flat = torch.randint(0, 256, (nbytes,), dtype=torch.uint8) if rank == 0 else None
    times = []
    for _ in range(WARMUP + reps):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            assert flat is not None
            dist.broadcast(torch.tensor([1, 2, nbytes], dtype=torch.int64), 0)
            dist.broadcast(flat, 0)
        else:
            header = torch.zeros(3, dtype=torch.int64)
            dist.broadcast(header, 0)
            buf = torch.empty(int(header[2]), dtype=torch.uint8)
            dist.broadcast(buf, 0)
        times.append(time.perf_counter() - t0)
    dist.barrier()
    dist.destroy_process_group()
    Path(out).write_text(json.dumps(times[WARMUP:]))


def run_loopback(nbytes: int, world: int = 3, reps: int = 100) -> dict[str, Any]:
    """Broadcast ``nbytes`` from rank 0 to ``world - 1`` receivers, ``reps`` times.
    Returns medians in ms, from the sender's view (as a policy ``sync`` event's ``ms``)
    and to the last receiver done (max over ranks, per repetition). Must be called
    under ``if __name__ == "__main__":`` (spawn)."""
    import torch.distributed as dist

    ctx = mp.get_context("spawn")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    procs = []
    with tempfile.TemporaryDirectory(prefix="phalanx-loopback-") as d:
        try:
            for r in range(world):
                out = str(Path(d) / f"rank{r}.json")
                p = ctx.Process(
                    target=loopback_worker, args=(r, world, store.port, nbytes, reps, out)
                )
                p.start()
                procs.append(p)
            deadline = time.monotonic() + TIMEOUT_S
            for p in procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
            codes = [p.exitcode for p in procs]
            if codes != [0] * world:
                raise RuntimeError(f"loopback ranks must all exit 0: got exit codes {codes}")
            per_rank = [json.loads((Path(d) / f"rank{r}.json").read_text()) for r in range(world)]
        finally:
            for p in procs:
                if p.is_alive() and p.pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p.pid, signal.SIGKILL)
                    p.join(timeout=5)
            del store
    sender = statistics.median(per_rank[0])
    slowest = statistics.median(max(ts) for ts in zip(*per_rank, strict=True))
    return {
        "bytes": nbytes,
        "processes": world,
        "reps": reps,
        "sender_ms_p50": round(sender * 1e3, 3),
        "all_ranks_ms_p50": round(slowest * 1e3, 3),
        "loopback_broadcast_gbps": round(nbytes / sender / 1e9, 4),
        "loopback_broadcast_all_ranks_gbps": round(nbytes / slowest / 1e9, 4),
    }

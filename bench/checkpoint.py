"""Checkpoint benchmark: save/load throughput against the disk, async-save stall,
and a resharding load, all in the same run.

    python bench/checkpoint.py [--json] [--mb 200] [--repeats 3] [--s3-mb 50] [--no-s3]
                               [--dir DIR]

The state (``--mb``, default about 200 MB of float32) is a model of 4 square
matrices plus AdamW's ``exp_avg`` and ``exp_avg_sq`` for each (and their
``step`` scalars): a third model, two thirds optimizer, as in training.

Figures (median over ``--repeats``; **gbps means GB/s, 1e9 bytes per second**):

- ``save_gbps``: bytes / wall time of ``Checkpointer.save`` (plan, write every
  chunk with its CRC32, fsync the data file, JSON metadata, manifest, rename
  into place, ``latest``), to a local directory (``--dir``, default a temp
  dir on the same disk as the repo's /tmp).
- ``disk_write_gbps``: a plain sequential write of the same tensors' bytes
  to one file in the same directory, then fsync: the same durability as the
  checkpoint writer. ``save_vs_disk`` = save_gbps / disk_write_gbps (goal
  >= 0.5).
- ``load_gbps``: bytes / wall time of ``Checkpointer.load(template)``: check
  every file's size and every chunk's CRC32, then read into the template.
  Before each load the checkpoint's files are dropped from the page cache
  (``posix_fadvise(DONTNEED)``; they are clean after the fsync), so this is a
  read from the disk, as after a restart. ``disk_read_gbps``: the baseline
  file read the same way.
- ``async_stall_s``: what ``save_async`` blocks the caller for (the copy to
  host memory); ``sync_save_s``: a blocking ``save`` of the same state;
  ``stall_vs_sync`` = their ratio (goal <= 0.1).
- ``reshard_load_s``: a checkpoint saved by 2 ranks, each holding half of
  every tensor as a DTensor sharded on dim 0 (``torchrun --standalone
  --nproc-per-node 2``, gloo), loaded by 1 process into full plain tensors;
  ``reshard_tp2_load_s``: the same checkpoint loaded by 2 ranks sharded on
  dim 1 (another tensor-parallel layout). Both are checked bit-exact.
- ``s3_save_gbps`` / ``s3_load_gbps``: the same on ``s3://`` against a local
  moto server (``--s3-mb`` of state; moto keeps objects in its own memory, so
  this measures the client path and the local HTTP server, not S3).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
GOALS = {"save_vs_disk": 0.5, "stall_vs_sync": 0.1}
SEED = 1234
WORKER_TIMEOUT_S = 300


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def make_state(mb: int, seed: int = SEED) -> dict[str, Any]:
    """~``mb`` MB: 4 model matrices, AdamW's two moments for each, step scalars."""
    import torch

    side = max(64, round((mb * 1e6 / 4 / 3 / 4) ** 0.5 / 64) * 64)
    g = torch.Generator().manual_seed(seed)
    model = {f"layers.{i}.weight": torch.randn(side, side, generator=g) for i in range(4)}
    state = {
        i: {
            "step": torch.tensor(10.0),
            "exp_avg": torch.randn(side, side, generator=g),
            "exp_avg_sq": torch.rand(side, side, generator=g),
        }
        for i in range(4)
    }
    return {
        "model": model,
        "optim": {"state": state, "param_groups": [{"lr": 1e-3, "params": [0, 1, 2, 3]}]},
        "step": 10,
        "data": {"cursor": 12345},
    }


def tensors_of(state: Any) -> list[Any]:
    from phalanx.comm.transfer import flatten

    return list(flatten(state, keyed=True)[1].values())


def nbytes(state: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors_of(state))


def zeros_like(state: Any) -> Any:
    import torch

    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like(v) for k, v in state.items()}
    if isinstance(state, list):
        return [zeros_like(v) for v in state]
    return state


def equal(a: Any, b: Any) -> bool:
    import torch

    ta, tb = tensors_of(a), tensors_of(b)
    return len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))


def drop_cache(path: Path) -> None:
    """Evict ``path``'s (clean) pages from the page cache, so the next read hits the disk."""
    for f in [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- local save / load against the disk -------------------------------------------


def disk_write(state: Any, path: Path) -> float:
    """Seconds to write the state's tensor bytes sequentially to one file, then fsync."""
    from phalanx.checkpoint.dcp_io import tensor_bytes

    t0 = time.perf_counter()
    with path.open("wb") as f:
        for t in tensors_of(state):
            f.write(tensor_bytes(t))
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def disk_read(path: Path) -> float:
    drop_cache(path)
    t0 = time.perf_counter()
    with path.open("rb", buffering=0) as f:
        while f.read(16 << 20):
            pass
    return time.perf_counter() - t0


def bench_local(mb: int, repeats: int, base: Path) -> dict[str, Any]:
    from phalanx.checkpoint import Checkpointer

    state = make_state(mb)
    size = nbytes(state)
    root = base / "local"
    saves, loads, writes, reads, stalls, asyncs = [], [], [], [], [], []
    ck = Checkpointer(str(root), keep_last=1)
    for r in range(repeats):
        raw = base / "baseline.bin"
        writes.append(disk_write(state, raw))
        reads.append(disk_read(raw))
        raw.unlink()

        t0 = time.perf_counter()
        ck.save(2 * r + 1, state)
        saves.append(time.perf_counter() - t0)

        template = zeros_like({"model": state["model"], "optim": state["optim"]})
        drop_cache(root)
        t0 = time.perf_counter()
        res = Checkpointer(str(root)).load(template)
        loads.append(time.perf_counter() - t0)
        assert res is not None and equal({"model": state["model"]}, {"model": template["model"]})
        assert equal(state["optim"]["state"], template["optim"]["state"])

        t0 = time.perf_counter()
        fut = ck.save_async(2 * r + 2, state)
        stalls.append(ck.last_stall_s)
        fut.result()
        asyncs.append(time.perf_counter() - t0)
    ck.close()
    med = statistics.median
    save_s, write_s = med(saves), med(writes)
    return {
        "state_bytes": size,
        "tensors": len(tensors_of(state)),
        "repeats": repeats,
        "save_s": round(save_s, 3),
        "save_gbps": round(size / save_s / 1e9, 3),
        "disk_write_s": round(write_s, 3),
        "disk_write_gbps": round(size / write_s / 1e9, 3),
        "save_vs_disk": round(write_s / save_s, 2),
        "load_s": round(med(loads), 3),
        "load_gbps": round(size / med(loads) / 1e9, 3),
        "disk_read_gbps": round(size / med(reads) / 1e9, 3),
        "load_vs_disk_read": round(med(reads) / med(loads), 2),
        "sync_save_s": round(save_s, 3),
        "async_stall_s": round(med(stalls), 4),
        "async_total_s": round(med(asyncs), 3),
        "stall_vs_sync": round(med(stalls) / save_s, 3),
        "save_s_all": [round(x, 3) for x in saves],
        "disk_write_s_all": [round(x, 3) for x in writes],
        "load_s_all": [round(x, 3) for x in loads],
        "async_stall_s_all": [round(x, 4) for x in stalls],
    }


# -- resharding: torchrun workers -------------------------------------------------


def _shard(state: Any, mesh: Any, dim: int) -> Any:
    """The state with every 2-D tensor a DTensor sharded on ``dim`` over ``mesh``."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            place = Shard(dim) if x.dim() == 2 else Replicate()
            return distribute_tensor(x, mesh, [place])
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        return x

    return walk(state)


def worker(mode: str, root: str, mb: int) -> int:
    """One torchrun rank (``save-tp2`` or ``load-tp2``), or a plain process (``load-1``).
    Prints one JSON line (rank 0)."""
    import torch
    import torch.distributed as dist

    from phalanx.checkpoint import Checkpointer

    full = make_state(mb)
    out: dict[str, Any] = {"mode": mode}
    if mode == "load-1":
        template = zeros_like({"model": full["model"], "optim": full["optim"]})
        t0 = time.perf_counter()
        res = Checkpointer(root).load(template)
        out["load_s"] = time.perf_counter() - t0
        assert res is not None and res.manifest.world_size == 2
        out["exact"] = equal(template["model"], full["model"]) and equal(
            template["optim"]["state"], full["optim"]["state"]
        )
        print(json.dumps(out), flush=True)
        return 0
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        if mode == "save-tp2":
            state = _shard(full, mesh, 0)
            ck = Checkpointer(root, layout={"tp": 2, "shard_dim": 0})
            dist.barrier()
            t0 = time.perf_counter()
            ck.save(1, state)
            out["save_s"] = time.perf_counter() - t0
            ck.close()
        else:
            template = _shard(zeros_like({"model": full["model"], "optim": full["optim"]}), mesh, 1)
            ck = Checkpointer(root)
            dist.barrier()
            t0 = time.perf_counter()
            res = ck.load(template)
            out["load_s"] = time.perf_counter() - t0
            assert res is not None
            mine = {k: v.full_tensor() for k, v in template["model"].items()}
            ok = torch.tensor([int(equal(mine, full["model"]))])
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
            out["exact"] = bool(ok.item())
            ck.close()
    finally:
        dist.destroy_process_group()
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(out), flush=True)
    return 0


def _run_worker(cmd: list[str]) -> dict[str, Any]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=WORKER_TIMEOUT_S,
        start_new_session=True,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"checkpoint worker {cmd[-5:]} must exit 0 with a JSON line: got rc "
            f"{proc.returncode}.\n{proc.stderr[-3000:]}"
        )
    return dict(json.loads(lines[-1]))


def bench_reshard(mb: int, base: Path) -> dict[str, Any]:
    root = str(base / "reshard")
    script = str(Path(__file__).resolve())
    me = [sys.executable, script]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    args = ["--root", root, "--mb", str(mb)]
    saved = _run_worker([*torchrun, "--nproc-per-node", "2", script, "--worker", "save-tp2", *args])
    drop_cache(Path(root))
    one = _run_worker([*me, "--worker", "load-1", *args])
    drop_cache(Path(root))
    tp2 = _run_worker([*torchrun, "--nproc-per-node", "2", script, "--worker", "load-tp2", *args])
    size = nbytes(make_state(mb))
    return {
        "reshard_state_bytes": size,
        "reshard_save_tp2_s": round(saved["save_s"], 3),
        "reshard_load_s": round(one["load_s"], 3),
        "reshard_load_gbps": round(size / one["load_s"] / 1e9, 3),
        "reshard_load_exact": one["exact"],
        "reshard_tp2_load_s": round(tp2["load_s"], 3),
        "reshard_tp2_load_exact": tp2["exact"],
    }


# -- s3 (moto) ----------------------------------------------------------------


def bench_s3(mb: int, repeats: int) -> dict[str, Any]:
    sys.path.insert(0, str(ROOT / "tests" / "integration"))
    from s3 import serve_s3

    from phalanx.checkpoint import Checkpointer

    state = make_state(mb)
    size = nbytes(state)
    saves, loads = [], []
    with serve_s3() as s3:
        url, opts = s3.sub("bench")
        ck = Checkpointer(url, storage_options=opts, keep_last=1)
        for r in range(repeats):
            t0 = time.perf_counter()
            ck.save(r + 1, state)
            saves.append(time.perf_counter() - t0)
            template = zeros_like({"model": state["model"], "optim": state["optim"]})
            t0 = time.perf_counter()
            res = Checkpointer(url, storage_options=opts).load(template)
            loads.append(time.perf_counter() - t0)
            assert res is not None and equal(template["model"], state["model"])
        ck.close()
    med = statistics.median
    return {
        "s3_state_bytes": size,
        "s3_save_gbps": round(size / med(saves) / 1e9, 3),
        "s3_load_gbps": round(size / med(loads) / 1e9, 3),
        "s3_server": "moto (local, in-memory)",
    }


# -- main -------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    import torch

    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--mb", type=int, default=200, help="state size in MB (default 200)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per figure (median)")
    p.add_argument("--s3-mb", type=int, default=50, help="state size for the s3 figures")
    p.add_argument("--no-s3", action="store_true", help="skip the s3 (moto) figures")
    p.add_argument("--no-reshard", action="store_true", help="skip the resharding figures")
    p.add_argument("--dir", type=Path, help="where checkpoints go (default: a temp dir)")
    p.add_argument("--worker", choices=["save-tp2", "load-1", "load-tp2"], help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.root, args.mb)
    if args.mb < 1 or args.repeats < 1:
        p.error(f"--mb and --repeats must be >= 1: got {args.mb} and {args.repeats}")
    import logging

    logging.getLogger("phalanx.checkpoint").setLevel(logging.WARNING)
    row: dict[str, Any] = {"loadavg_start": loadavg()}
    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="phalanx-ckpt-bench-", dir=args.dir))
    try:
        row.update(bench_local(args.mb, args.repeats, base))
        if not args.no_reshard:
            row.update(bench_reshard(args.mb, base))
        if not args.no_s3:
            try:
                row.update(bench_s3(args.s3_mb, args.repeats))
            except ImportError as e:
                row["s3_reason"] = f"s3 skipped: {e} (install the dev extra)"
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(base)
    row["goals"] = {
        "save_vs_disk": {
            "goal": f">= {GOALS['save_vs_disk']}",
            "met": row["save_vs_disk"] >= GOALS["save_vs_disk"],
        },
        "stall_vs_sync": {
            "goal": f"<= {GOALS['stall_vs_sync']}",
            "met": row["stall_vs_sync"] <= GOALS["stall_vs_sync"],
        },
    }
    row["loadavg_end"] = loadavg()
    row["machine"] = machine()
    row["dir"] = str(args.dir or tempfile.gettempdir())
    if args.json:
        print(json.dumps(row), flush=True)
    else:
        _table(row)
    return 0


def _table(r: dict[str, Any]) -> None:
    mb = r["state_bytes"] / 1e6
    rows = [
        ("state", f"{mb:.0f} MB in {r['tensors']} tensors, {r['repeats']} repeats (median)"),
        ("save", f"{r['save_gbps']} GB/s ({r['save_s']} s)"),
        ("disk write+fsync", f"{r['disk_write_gbps']} GB/s ({r['disk_write_s']} s)"),
        ("save / disk", f"{r['save_vs_disk']} (goal >= {GOALS['save_vs_disk']})"),
        ("load (verify+read)", f"{r['load_gbps']} GB/s ({r['load_s']} s)"),
        ("disk read", f"{r['disk_read_gbps']} GB/s"),
        ("async stall", f"{r['async_stall_s']} s (sync save {r['sync_save_s']} s)"),
        ("stall / sync", f"{r['stall_vs_sync']} (goal <= {GOALS['stall_vs_sync']})"),
    ]
    if "reshard_load_s" in r:
        rows += [
            ("reshard tp2 -> 1", f"{r['reshard_load_s']} s, exact={r['reshard_load_exact']}"),
            (
                "reshard tp2 dim0 -> dim1",
                f"{r['reshard_tp2_load_s']} s, exact={r['reshard_tp2_load_exact']}",
            ),
        ]
    if "s3_save_gbps" in r:
        rows.append(
            (
                "s3 (moto)",
                f"save {r['s3_save_gbps']} GB/s, load {r['s3_load_gbps']} GB/s "
                f"({r['s3_state_bytes'] / 1e6:.0f} MB)",
            )
        )
    for k, v in rows:
        print(f"{k:>26}  {v}")
    m = r["machine"]
    print(
        f"\n{platform.node()}: {m['cpus']} CPUs, python {m['python']}, torch {m['torch']}, "
        f"load {r['loadavg_start']} -> {r['loadavg_end']}"
    )


if __name__ == "__main__":
    sys.exit(main())

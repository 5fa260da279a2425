"""Transport benchmark: weight stores, each against its baseline in the same run.

    python bench/transports.py [--json] [--weights-mb 100] [--redis-weights-mb 25]
                               [--repeats 3] [--no-redis] [--dir DIR]

**Weights** (``WeightStore``): a ``--weights-mb`` state dict of float32 (6 large
matrices and 32 small vectors) published and fetched (by a fresh store, as a
rollout replica would) through ``StorageWeightStore`` on ``file://``, median of
``--repeats``. ``publish_gbps``, ``fetch_gbps``, ``publish_fetch_gbps`` (bytes /
(publish + fetch seconds)), against ``disk_write_gbps``: the same tensors' bytes
written sequentially to one file in the same directory, then fsync.
The disk baseline writes a new file per repeat and deletes the one before last,
the same file churn as the store (``keep=2``).
``RedisWeightStore`` ("for small models", a 512 MiB cap) is measured the same
way with a ``--redis-weights-mb`` model, reported separately, against a
``redis-server`` this script starts on a free port (persistence off;
``tests/integration/redis_server.py``) and kills by its pid at the end
(``--no-redis`` leaves it out). **gbps means GB/s, 1e9 bytes per second.**
Every fetch is checked bit-exact.

The rollout-queue arms this benchmark had (``RolloutQueue`` on the controller,
Redis Streams and a storage spool) went with those backends: no job used them.

``loadavg_start`` / ``loadavg_end``: this runs on a shared, noisy machine.
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
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from phalanx.transport.base import WeightStore

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))

SEED = 1234


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def serve_redis(base: Path, stack: contextlib.ExitStack) -> str:
    """A ``redis-server`` on a free port, stopped by its pid when ``stack`` closes."""
    from redis_server import serve_redis as start
    from redis_server import stop

    if shutil.which("redis-server") is None:
        raise RuntimeError(
            "redis-server is not installed: apt-get install -y redis-server, or pass --no-redis"
        )
    proc, url = start(base / "redis")
    stack.callback(stop, proc)  # os.killpg of its own session: by pid, never by name
    return url


# -- weights --------------------------------------------------------------------


def make_weights(mb: float, seed: int = SEED) -> dict[str, torch.Tensor]:
    """~``mb`` MB of float32: 6 large matrices (a model's bulk) and 32 small vectors."""
    import torch

    g = torch.Generator().manual_seed(seed)
    small = {f"layers.{i}.norm.weight": torch.randn(2048, generator=g) for i in range(32)}
    rows = max(1, round((mb * 1e6 - 32 * 2048 * 4) / 4 / 6 / 2048))
    big = {f"layers.{i}.mlp.weight": torch.randn(rows, 2048, generator=g) for i in range(6)}
    return {**big, **small}


def disk_write(weights: dict[str, torch.Tensor], path: Path) -> float:
    """Seconds to write the tensors' bytes sequentially to one new file, then fsync."""
    t0 = time.perf_counter()
    with path.open("wb") as f:
        for t in weights.values():
            f.write(memoryview(t.numpy()).cast("B"))
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def bench_store(
    open_store: Callable[[], WeightStore], weights: dict[str, torch.Tensor], repeats: int
) -> dict[str, Any]:
    import torch

    size = sum(t.numel() * t.element_size() for t in weights.values())
    pub, fet = [], []
    store = open_store()
    try:
        for r in range(repeats):
            t0 = time.perf_counter()
            store.publish(r + 1, weights, {"seq": r + 1})
            pub.append(time.perf_counter() - t0)
            reader = open_store()
            t0 = time.perf_counter()
            v, got = reader.fetch()
            fet.append(time.perf_counter() - t0)
            reader.close()
            assert v == r + 1 and got.keys() == weights.keys()
            assert all(torch.equal(got[k], t) for k, t in weights.items()), "fetch not exact"
    finally:
        store.close()
    p, f = statistics.median(pub), statistics.median(fet)
    return {
        "bytes": size,
        "tensors": len(weights),
        "publish_s": round(p, 3),
        "fetch_s": round(f, 3),
        "publish_gbps": round(size / p / 1e9, 3),
        "fetch_gbps": round(size / f / 1e9, 3),
        "publish_fetch_gbps": round(size / (p + f) / 1e9, 3),
        "publish_s_all": [round(x, 3) for x in pub],
        "fetch_s_all": [round(x, 3) for x in fet],
    }


def bench_weights(
    base: Path, mb: float, redis_mb: float, repeats: int, redis_url: str | None
) -> dict[str, Any]:
    from phalanx.transport.storage_weights import StorageWeightStore

    weights = make_weights(mb)
    # A new file per repeat, the one before last deleted after: the same file churn
    # as a store with keep=2 (on this VM, rewriting pages just freed is several
    # times faster than filling fresh ones, so both must see the same pattern).
    writes = []
    for r in range(repeats):
        writes.append(disk_write(weights, base / f"disk-{r}.bin"))
        if r >= 2:
            (base / f"disk-{r - 2}.bin").unlink()
    for r in range(max(0, repeats - 2), repeats):
        (base / f"disk-{r}.bin").unlink()
    size = sum(t.numel() * t.element_size() for t in weights.values())
    disk = size / statistics.median(writes) / 1e9
    url = (base / "weights").as_uri()
    storage = bench_store(lambda: StorageWeightStore(url, keep=2), weights, repeats)
    storage["disk_write_gbps"] = round(disk, 3)
    storage["disk_write_s_all"] = [round(x, 3) for x in writes]
    storage["publish_vs_disk"] = round(storage["publish_gbps"] / disk, 2)
    storage["publish_fetch_vs_disk"] = round(storage["publish_fetch_gbps"] / disk, 2)
    out: dict[str, Any] = {"storage": storage}
    if redis_url is not None:
        from phalanx.transport.redis_weights import RedisWeightStore

        small = make_weights(redis_mb)
        name = f"bench-{uuid.uuid4().hex[:8]}"
        rs = bench_store(lambda: RedisWeightStore(redis_url, name, keep=2), small, repeats)
        rs["vs_storage_publish_fetch"] = round(
            rs["publish_fetch_gbps"] / storage["publish_fetch_gbps"], 2
        )
        out["redis"] = rs
    return out


# -- main -----------------------------------------------------------------------


def machine() -> dict[str, Any]:
    import torch

    redis_version = ""
    if shutil.which("redis-server"):
        redis_version = (
            subprocess.run(
                ["redis-server", "--version"], capture_output=True, text=True, check=False
            )
            .stdout.split()[2]
            .removeprefix("v=")
        )
    return {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "redis_server": redis_version,
        "platform": platform.platform(),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--weights-mb", type=float, default=100, help="model size for storage")
    p.add_argument("--redis-weights-mb", type=float, default=25, help="model size for redis")
    p.add_argument("--repeats", type=int, default=3, help="weight repeats (median)")
    p.add_argument("--no-redis", action="store_true", help="leave RedisWeightStore out")
    p.add_argument("--dir", type=Path, help="where weights go (default: a temp dir)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1: got {args.repeats}")
    t_start = time.perf_counter()
    row: dict[str, Any] = {"loadavg_start": loadavg()}
    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="phalanx-transports-bench-", dir=args.dir))
    try:
        with contextlib.ExitStack() as stack:
            redis_url = None if args.no_redis else serve_redis(base, stack)
            row["weights"] = bench_weights(
                base, args.weights_mb, args.redis_weights_mb, args.repeats, redis_url
            )
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(base)
    row["loadavg_end"] = loadavg()
    row["wall_s"] = round(time.perf_counter() - t_start, 1)
    row["machine"] = machine()
    row["dir"] = str(args.dir or tempfile.gettempdir())
    if args.json:
        print(json.dumps(row), flush=True)
    else:
        _table(row)
    return 0


def _table(r: dict[str, Any]) -> None:
    w = r["weights"]["storage"]
    print(
        f"weights, storage ({w['bytes'] / 1e6:.0f} MB): publish {w['publish_gbps']} GB/s, "
        f"fetch {w['fetch_gbps']} GB/s, publish+fetch {w['publish_fetch_gbps']} GB/s; "
        f"disk write+fsync {w['disk_write_gbps']} GB/s; ratio {w['publish_fetch_vs_disk']}"
    )
    if "redis" in r["weights"]:
        w = r["weights"]["redis"]
        print(
            f"weights, redis ({w['bytes'] / 1e6:.0f} MB): publish {w['publish_gbps']} GB/s, "
            f"fetch {w['fetch_gbps']} GB/s, publish+fetch {w['publish_fetch_gbps']} GB/s"
        )
    m = r["machine"]
    print(
        f"\n{platform.node()}: {m['cpus']} CPUs, python {m['python']}, torch {m['torch']}, "
        f"redis {m['redis_server']}, load {r['loadavg_start']} -> {r['loadavg_end']}, "
        f"{r['wall_s']} s"
    )


if __name__ == "__main__":
    sys.exit(main())

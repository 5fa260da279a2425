"""Transport benchmark: rollout queues and weight stores, each against its baseline
in the same run.

    python bench/transports.py [--json] [--rollouts 2048] [--backends redis,storage]
                               [--weights-mb 100] [--redis-weights-mb 25] [--repeats 3]
                               [--dir DIR]

**Rollout queues** (``RolloutQueue``), one entry per backend in :data:`BACKENDS`:

- ``controller``: ``ControllerRolloutQueue``, a queue held by a real controller
  (``python -m phalanx.cli controller`` on port 0, ``bench/controller.py``),
  journaled to its SQLite before each answer, stopped by its pid at the end.
- ``redis``: ``RedisRolloutQueue`` against a ``redis-server`` this script starts on
  a free port (persistence off; ``tests/integration/redis_server.py``), killed by
  its pid at the end.
- ``storage``: ``SpoolRolloutQueue`` on a ``file://`` temp dir (``--dir``).

A rollout is what a rollout replica makes (``rl/generate.py``, ``make_rollouts``,
plus a ``lease_id``, as a queued rollout carries it): ``rollout_id``, ``version``,
``reward``, ``exact_match``, ``lease_id`` and one completion of ``prompt_ids``
(128), ``token_ids`` (512), ``logprobs`` (512 floats at full precision),
``finished`` and ``reward``, plus ``t_put`` (the producer's ``time.time()`` just
before its ``put``). Producers are separate processes (this script with
``--producer``; arguments and results travel as JSON, never pickle), each
putting groups of 16 rollouts per ``put``. One consumer (this process) drains
as a consumer of the queue would: ``lease(64, wait_s=0.5)``, then ``ack``.
Each configuration (1 producer, 8 producers) runs on a fresh queue, twice:

- *saturated*: the producers put ``--rollouts`` rollouts in all as fast as they
  can. ``rollouts_per_s`` = rollouts leased and acked / seconds from "go" to
  the last ack. ``p99_latency_saturated_ms`` is taken here too, but it mostly
  measures the backlog (producers outrun the consumer).
- *paced*: the producers put at half the saturated rate, evenly spread (open
  loop), for ``min(--rollouts / 2, 4 s worth)`` rollouts. ``p50_latency_ms`` /
  ``p99_latency_ms``: from ``t_put`` to the consumer holding the lease, per
  rollout. This is the transport's latency, not the backlog's.

Every run checks that each rollout id was delivered, and counts redeliveries.

**Redis baseline**: ``redis-benchmark -p PORT -n N -q -x XADD <stream> * f``
with a payload (stdin) of the size of one encoded rollout, on the same server,
with 50 clients (its default) and with 1 and 8 clients, no pipelining.
``vs_xadd_p1`` / ``vs_xadd_p8`` = our ``rollouts_per_s`` / the 50-client XADD rate.

**Codec baseline**: every backend carries a rollout as compact JSON.
``rollout.encode_us`` / ``decode_us``: ``json.dumps`` / ``json.loads`` of one
rollout in this process; ``encode_bound_rollouts_per_s``: what one producer
could put doing nothing but encode. ``vs_encode_bound_p1`` = the 1-producer
``rollouts_per_s`` / that bound (1.0: the transport costs nothing on top).

**Weights** (``WeightStore``): a ``--weights-mb`` state dict of float32 (6 large
matrices and 32 small vectors) published and fetched (by a fresh store, as a
rollout replica would) through ``StorageWeightStore`` on ``file://``, median of
``--repeats``. ``publish_gbps``, ``fetch_gbps``, ``publish_fetch_gbps`` (bytes /
(publish + fetch seconds)), against ``disk_write_gbps``: the same tensors' bytes
written sequentially to one file in the same directory, then fsync.
The disk baseline writes a new file per repeat and deletes the one before last,
the same file churn as the store (``keep=2``).
``RedisWeightStore`` ("for small models", a 512 MiB cap) is measured the same
way with a ``--redis-weights-mb`` model, reported separately. **gbps means GB/s,
1e9 bytes per second.** Every fetch is checked bit-exact.

``loadavg_start`` / ``loadavg_end``: this runs on a shared, noisy machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import torch

    from phalanx.transport.base import RolloutQueue, WeightStore

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "integration"))

PROMPT_TOKENS, TOKENS = 128, 512
GROUP = 16
"""Rollouts per put: one prompt lease's worth."""
LEASE_BATCH, LEASE_WAIT_S = 64, 0.5
"""Leases of a consumer draining the queue: 64 at a time, waiting up to 0.5 s."""
PRODUCERS = (1, 8)
PACED_FRACTION = 0.5
PACED_MAX_S = 4.0
DRAIN_TIMEOUT_S = 120.0
SEED = 1234


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


# -- backends -------------------------------------------------------------------
#
# A backend is one entry here: ``serve`` starts what the queue needs (anything it
# starts, it registers on the ExitStack to stop by pid) and returns its *spec*,
# JSON that ``open`` takes, in this process and in every producer process.
# ``open(spec, run, consumer)``: a queue; ``run`` names a fresh queue per measured run.


@dataclass(frozen=True)
class Backend:
    serve: Callable[[Path, contextlib.ExitStack], dict[str, Any]]
    open: Callable[[dict[str, Any], str, str], RolloutQueue]


def serve_redis(base: Path, stack: contextlib.ExitStack) -> dict[str, Any]:
    from redis_server import serve_redis as start
    from redis_server import stop

    if shutil.which("redis-server") is None:
        raise RuntimeError("redis-server is not installed: apt-get install -y redis-server")
    proc, url = start(base / "redis")
    stack.callback(stop, proc)  # os.killpg of its own session: by pid, never by name
    return {"url": url, "pid": proc.pid}


def open_redis(spec: dict[str, Any], run: str, consumer: str) -> RolloutQueue:
    from phalanx.transport.redis_queue import RedisRolloutQueue

    return RedisRolloutQueue(spec["url"], run, consumer, lease_s=60.0)


def serve_storage(base: Path, stack: contextlib.ExitStack) -> dict[str, Any]:
    root = base / "spool"
    root.mkdir()
    return {"url": root.as_uri()}


def open_storage(spec: dict[str, Any], run: str, consumer: str) -> RolloutQueue:
    from phalanx.transport.spool import SpoolRolloutQueue

    return SpoolRolloutQueue(spec["url"], consumer, name=run, lease_s=60.0)


def serve_controller(base: Path, stack: contextlib.ExitStack) -> dict[str, Any]:
    from controller import controller  # bench/controller.py: a real controller on port 0

    ctl = stack.enter_context(controller(base, "controller", 1))
    return {"state": str(base / "controller"), "url": ctl.url, "pid": ctl.pid}


def open_controller(spec: dict[str, Any], run: str, consumer: str) -> RolloutQueue:
    from phalanx.transport.factory import open_queue

    return open_queue("controller", run, consumer, lease_s=60.0, controller=spec["state"])


BACKENDS: dict[str, Backend] = {
    "controller": Backend(serve_controller, open_controller),
    "redis": Backend(serve_redis, open_redis),
    "storage": Backend(serve_storage, open_storage),
}


# -- rollouts -------------------------------------------------------------------


def templates(seed: int, n: int = GROUP) -> list[dict[str, Any]]:
    """``n`` distinct rollouts of realistic size and content (ids set at put time)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        reward = float(rng.random() < 0.5)
        out.append(
            {
                "rollout_id": "",
                "version": 7,
                "reward": reward,
                "exact_match": reward,
                "completions": [
                    {
                        "prompt_ids": [rng.randrange(32000) for _ in range(PROMPT_TOKENS)],
                        "token_ids": [rng.randrange(32000) for _ in range(TOKENS)],
                        "logprobs": [-rng.expovariate(2.0) for _ in range(TOKENS)],
                        "finished": True,
                        "reward": reward,
                    }
                ],
                "lease_id": uuid.uuid4().hex,
                "t_put": 0.0,
            }
        )
    return out


def encoded_size() -> int:
    r = {**templates(SEED, 1)[0], "rollout_id": "p0-00000000", "t_put": time.time()}
    return len(json.dumps(r, separators=(",", ":")).encode())


def codec_bound() -> dict[str, Any]:
    """Every backend sends a rollout as compact JSON: what one process's
    ``json.dumps`` / ``json.loads`` of these rollouts costs, and so the rate one
    producer (or the consumer) could reach doing nothing else."""
    tpl = templates(SEED)
    t0 = time.perf_counter()
    enc = [json.dumps(r, separators=(",", ":")) for _ in range(8) for r in tpl]
    t1 = time.perf_counter()
    for e in enc:
        json.loads(e)
    t2 = time.perf_counter()
    n = len(enc)
    return {
        "encode_us": round(1e6 * (t1 - t0) / n, 1),
        "decode_us": round(1e6 * (t2 - t1) / n, 1),
        "encode_bound_rollouts_per_s": round(n / (t1 - t0), 1),
        "decode_bound_rollouts_per_s": round(n / (t2 - t1), 1),
    }


def producer(args: dict[str, Any]) -> int:
    """One producer process: ``ready``, wait for ``go`` on stdin, put, print a JSON line."""
    q = BACKENDS[args["backend"]].open(args["spec"], args["run"], f"producer-{args['index']}")
    tpl = templates(SEED + args["index"])
    count, rate = args["count"], args["rate"]
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    t_go = time.time()
    # Paced: this producer's groups every `every` s, staggered among the producers.
    every = GROUP / rate if rate > 0 else 0.0
    offset = every * args["index"] / max(1, args["producers"])
    put_s: list[float] = []
    sent = 0
    while sent < count:
        if every:
            wait = t_go + offset + every * len(put_s) - time.time()
            if wait > 0:
                time.sleep(wait)
        n = min(GROUP, count - sent)
        now = time.time()
        batch = [
            {**tpl[i], "rollout_id": f"p{args['index']}-{sent + i:08d}", "t_put": now}
            for i in range(n)
        ]
        t0 = time.perf_counter()
        queued = q.put(batch)
        put_s.append(time.perf_counter() - t0)
        assert len(queued) == n, f"put must queue every new rollout: got {len(queued)} of {n}"
        sent += n
    q.close()
    print(json.dumps({"sent": sent, "put_s": put_s, "t_done": time.time()}), flush=True)
    return 0


def run_queue(
    name: str, spec: dict[str, Any], producers: int, total: int, rate: float
) -> dict[str, Any]:
    """One measured run on a fresh queue: ``producers`` processes put ``total`` rollouts
    (at ``rate`` per second in all, 0: flat out) while this process drains them."""
    run = f"bench-{uuid.uuid4().hex[:8]}"
    q = BACKENDS[name].open(spec, run, "consumer")
    per = [total // producers + (i < total % producers) for i in range(producers)]
    procs = []
    try:
        for i, count in enumerate(per):
            args = {
                "backend": name,
                "spec": spec,
                "run": run,
                "index": i,
                "producers": producers,
                "count": count,
                "rate": rate / producers,
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, __file__, "--producer", json.dumps(args)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=ROOT,
                    start_new_session=True,
                )
            )
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline().strip()
            if line != "ready":
                raise RuntimeError(f"producer must print 'ready': got {line!r} (rc {p.poll()})")
        t_go = time.time()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        seen: set[str] = set()
        lat: list[float] = []
        redelivered, leases = 0, 0
        deadline = time.monotonic() + DRAIN_TIMEOUT_S
        while len(seen) < total:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{name}: the consumer must drain {total} rollouts within "
                    f"{DRAIN_TIMEOUT_S} s: got {len(seen)}."
                )
            got = q.lease(LEASE_BATCH, LEASE_WAIT_S)
            now = time.time()
            leases += bool(got)
            for d in got:
                if d.rollout_id in seen:
                    redelivered += 1
                else:
                    seen.add(d.rollout_id)
                    lat.append(now - d.rollout["t_put"])
            q.ack(got)
        t_end = time.time()
        outs = []
        for p in procs:
            out, _ = p.communicate(timeout=60)
            if p.returncode != 0:
                raise RuntimeError(f"producer must exit 0: got rc {p.returncode}")
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
        q.close()
    put_s = [s for o in outs for s in o["put_s"]]
    return {
        "rollouts": total,
        "seconds": round(t_end - t_go, 3),
        "rollouts_per_s": round(total / (t_end - t_go), 1),
        "put_rollouts_per_s": round(total / (max(o["t_done"] for o in outs) - t_go), 1),
        "put_ms_p50": round(1e3 * statistics.median(put_s), 2),
        "p50_latency_ms": round(1e3 * pct(lat, 0.5), 1),
        "p99_latency_ms": round(1e3 * pct(lat, 0.99), 1),
        "mean_lease": round(total / max(1, leases), 1),
        "redelivered": redelivered,
    }


def bench_queue(name: str, spec: dict[str, Any], total: int) -> dict[str, Any]:
    row: dict[str, Any] = {}
    for n in PRODUCERS:
        sat = run_queue(name, spec, n, total, 0.0)
        rate = PACED_FRACTION * sat["rollouts_per_s"]
        paced_n = max(GROUP * n, min(total // 2, int(rate * PACED_MAX_S)))
        paced = run_queue(name, spec, n, paced_n, rate)
        row[f"producers_{n}"] = {
            "rollouts": total,
            "rollouts_per_s": sat["rollouts_per_s"],
            "p50_latency_ms": paced["p50_latency_ms"],
            "p99_latency_ms": paced["p99_latency_ms"],
            "paced_rollouts_per_s": round(rate, 1),
            "paced_rollouts": paced_n,
            "p99_latency_saturated_ms": sat["p99_latency_ms"],
            "put_rollouts_per_s": sat["put_rollouts_per_s"],
            "put_ms_p50": sat["put_ms_p50"],
            "mean_lease": sat["mean_lease"],
            "seconds": sat["seconds"],
            "redelivered": sat["redelivered"] + paced["redelivered"],
        }
    return row


def redis_benchmark(url: str, payload_bytes: int, clients: int, n: int) -> float:
    """XADD requests per second from ``redis-benchmark`` (no pipelining)."""
    import redis

    parts = urlsplit(url)
    stream = f"bench:xadd:{uuid.uuid4().hex[:8]}"
    cmd = ["redis-benchmark", "-h", str(parts.hostname), "-p", str(parts.port)]
    cmd += ["-c", str(clients), "-n", str(n), "--csv", "-x", "XADD", stream, "*", "f"]
    out = subprocess.run(
        cmd, input=b"x" * payload_bytes, capture_output=True, timeout=120, check=True
    ).stdout.decode()
    redis.Redis.from_url(url).delete(stream)
    # --csv: a header line, then "<test>","<rps>",...
    row = [ln for ln in out.splitlines() if ln.startswith('"XADD')][-1]
    return float(row.split('","')[1])


def bench_redis_baseline(url: str, payload_bytes: int, n: int) -> dict[str, Any]:
    return {
        "xadd_per_s": round(redis_benchmark(url, payload_bytes, 50, n), 1),
        "xadd_per_s_1_client": round(redis_benchmark(url, payload_bytes, 1, n // 4), 1),
        "xadd_per_s_8_clients": round(redis_benchmark(url, payload_bytes, 8, n // 2), 1),
        "payload_bytes": payload_bytes,
    }


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
    p.add_argument("--rollouts", type=int, default=2048, help="rollouts per saturated run")
    p.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated queue backends")
    p.add_argument("--weights-mb", type=float, default=100, help="model size for storage")
    p.add_argument("--redis-weights-mb", type=float, default=25, help="model size for redis")
    p.add_argument("--repeats", type=int, default=3, help="weight repeats (median)")
    p.add_argument("--xadd-requests", type=int, default=20000, help="redis-benchmark -n")
    p.add_argument("--dir", type=Path, help="where spools and weights go (default: a temp dir)")
    p.add_argument("--producer", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.producer:
        return producer(json.loads(args.producer))
    names = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(names) - set(BACKENDS))
    if unknown:
        p.error(f"--backends must name backends in {sorted(BACKENDS)}: got {unknown}")
    if args.rollouts < GROUP * max(PRODUCERS) or args.repeats < 1:
        p.error(f"--rollouts must be >= {GROUP * max(PRODUCERS)} and --repeats >= 1")
    t_start = time.perf_counter()
    row: dict[str, Any] = {"loadavg_start": loadavg()}
    size = encoded_size()
    row["rollout"] = {
        "prompt_tokens": PROMPT_TOKENS,
        "completion_tokens": TOKENS,
        "encoded_bytes": size,
        "rollouts_per_put": GROUP,
        "lease_batch": LEASE_BATCH,
        **codec_bound(),
    }
    if args.dir:
        args.dir.mkdir(parents=True, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="phalanx-transports-bench-", dir=args.dir))
    redis_url = None
    try:
        with contextlib.ExitStack() as stack:
            row["backends"] = {}
            for name in names:
                spec = BACKENDS[name].serve(base, stack)
                res = bench_queue(name, spec, args.rollouts)
                if name == "redis":
                    redis_url = spec["url"]
                    xadd = bench_redis_baseline(redis_url, size, args.xadd_requests)
                    res["redis_benchmark"] = xadd
                    for n in PRODUCERS:
                        res[f"vs_xadd_p{n}"] = round(
                            res[f"producers_{n}"]["rollouts_per_s"] / xadd["xadd_per_s"], 3
                        )
                res["vs_encode_bound_p1"] = round(
                    res["producers_1"]["rollouts_per_s"]
                    / row["rollout"]["encode_bound_rollouts_per_s"],
                    3,
                )
                row["backends"][name] = res
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
    ro = r["rollout"]
    print(
        f"rollout: {ro['completion_tokens']} tokens + logprobs, {ro['encoded_bytes']} B as JSON, "
        f"{ro['rollouts_per_put']} per put, leased {ro['lease_batch']} at a time; json "
        f"encode {ro['encode_us']} us, decode {ro['decode_us']} us (one process: "
        f"{ro['encode_bound_rollouts_per_s']}/s encoding)\n"
    )
    print(
        f"{'backend':>10} {'prod':>4} {'rollouts/s':>11} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'vs XADD':>8} {'vs encode':>9}"
    )
    for name, b in r["backends"].items():
        for n in PRODUCERS:
            c = b[f"producers_{n}"]
            vs = b.get(f"vs_xadd_p{n}", "")
            ve = b.get(f"vs_encode_bound_p{n}", "")
            print(
                f"{name:>10} {n:>4} {c['rollouts_per_s']:>11} {c['p50_latency_ms']:>8} "
                f"{c['p99_latency_ms']:>8} {vs:>8} {ve:>9}"
            )
        if "redis_benchmark" in b:
            x = b["redis_benchmark"]
            print(
                f"{'':>10} redis-benchmark XADD ({x['payload_bytes']} B): {x['xadd_per_s']}/s "
                f"(50 clients), {x['xadd_per_s_8_clients']}/s (8), {x['xadd_per_s_1_client']}/s (1)"
            )
    w = r["weights"]["storage"]
    print(
        f"\nweights, storage ({w['bytes'] / 1e6:.0f} MB): publish {w['publish_gbps']} GB/s, "
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

"""Controller benchmark: quorum latency and heartbeat load at N replicas, next to
torchft's lighthouse on the same N.

    python bench/controller.py [--json] [--n 10,100,1000,10000] [--rounds R]

For each N it starts a real controller (``python -m phalanx.cli controller``)
in a temp state dir, with a job whose every round waits for all N
(``n_init_replicas = N``, ``join_timeout_s = 60``), and drives it from a few
worker processes that simulate the replicas over raw HTTP/1.1 keep-alive
connections (asyncio, uvloop where installed), so that the load generator
costs little next to the controller. Each simulated replica:

- heartbeats at 1 Hz: as the real client does where the controller's file
  descriptors allow a held connection per replica (a long-poll with
  ``wait_s = 1.0``, held for ``heartbeat_interval_s``); else (``--heartbeats
  pooled``, chosen by ``auto`` above about N = 9,700 on a 20,000-descriptor
  machine) unheld heartbeats, each its own request, over N/10 connections
  (:class:`PooledHeartbeats`);
- runs quorum rounds: round r starts at ``t0 + r * interval`` (a training
  step of ``--interval-s``; a late round starts at once), asks for the
  quorum at step r, parses the brief, and holds the member list, fetched
  (``POST /v1/quorum/members``) only when the brief names a digest it does
  not hold, as the real client does. It checks that the list holds all N.

Figures (over the rounds after ``--warmup`` warm-up rounds):

- ``quorum_p50_ms`` / ``quorum_p99_ms``: per replica per round, from sending
  its quorum request to holding the parsed answer and its member list.
- ``round_ms_p50``: per round, from the first request sent to the last
  answer received, which is what a training step waits for.
- ``heartbeats_per_s``: counted by the controller (``phalanx_heartbeats_total``
  on ``/metrics``) over the measured rounds.
- ``controller_cpu_percent``: the controller process over the same window
  (100 = one core). ``loadgen_cpu_percent`` is the load workers' total.
- ``quorum_reply_bytes``, ``member_lists_fetched`` (by the replicas, warm-up
  included) and ``member_lists_served`` (``/metrics``): one list per replica
  per change of membership, and a reply whose size does not grow with N.

The torchft side runs the same N, rounds, schedule and 1 Hz heartbeats
against a ``LighthouseServer`` (its Python binding's defaults for the
timing knobs, ``min_replicas = N``) in its own process, from worker
processes with one thread and one ``LighthouseClient`` per replica (plus a
few heartbeat threads). ``--torchft-timeout-s`` bounds each of its phases;
the row then says where it stopped (``torchft_reason``).

Last, fast failure detection: 3 replica processes form a quorum, one is
SIGKILLed, a survivor reports it (``POST /v1/report-failure``) and asks for
the next quorum. ``evict_after_report_ms`` is the time from sending the
report to the controller's status no longer listing the victim.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import multiprocessing as mp
import os
import platform
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import httpx
import psutil
from pydantic import BaseModel

from phalanx.protocol.membership import (
    HeartbeatReply,
    HeartbeatReq,
    QuorumReply,
    QuorumReq,
    RegisterReply,
    RegisterReq,
    ReportReply,
    ReportReq,
)
from phalanx.protocol.quorum import (
    MembersReply,
    MembersReq,
    QuorumBrief,
    QuorumPeer,
    members_of,
    roster_digest,
)
from phalanx.protocol.status import Status

R = TypeVar("R", bound=BaseModel)

ROLE = "policy"
QUORUM_WAIT_S = 30.0
CONNECT_BATCH = 100
READY_TIMEOUT_S = 300.0
JOIN_TIMEOUT_S = 60.0
DRIVE_TIMEOUT_S = 600.0
HEARTBEAT_THREADS = 8
FETCHES_AT_ONCE = 32
"""Member-list fetches one load worker has in flight: at N = 10,000 a list is ~1 MB,
and 5,000 replicas fetching at once would hold 5 GB in one process."""
FD_MARGIN = 512
"""File descriptors a controller needs besides its replicas' connections."""
PIPELINED = 1000
"""Pooled heartbeats one connection has in flight at most: enough that the load
generator never holds a heartbeat back for a slow controller (it would then measure
a lighter load than 1 Hz a replica)."""
SLOTS = 100
"""Pooled heartbeats are sent in this many slots a second."""


# -- a minimal HTTP/1.1 client -------------------------------------------------


class Conn:
    """One keep-alive HTTP/1.1 connection, one request at a time. Much cheaper per
    request than httpx, so that 2000 connections fit beside the controller."""

    def __init__(self, url: str, token: str):
        u = urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self._head = (
            f"HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nAuthorization: Bearer {token}\r\n"
            f"Content-Type: application/json\r\n"
        ).encode()
        self._r: asyncio.StreamReader | None = None
        self._w: asyncio.StreamWriter | None = None

    async def open(self) -> Conn:
        self._r, self._w = await asyncio.open_connection(self.host, self.port)
        return self

    async def request(self, method: bytes, path: bytes, body: bytes = b"") -> tuple[int, bytes]:
        self.send(method, path, body)
        return await self.response()

    def send(self, method: bytes, path: bytes, body: bytes = b"") -> None:
        """Write a request; :meth:`response` reads the replies in the order sent."""
        assert self._w is not None, "open() the connection first"
        self._w.write(
            b"%s %s %sContent-Length: %d\r\n\r\n%s" % (method, path, self._head, len(body), body)
        )

    async def response(self) -> tuple[int, bytes]:
        assert self._r is not None, "open() the connection first"
        head = await self._r.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        i = head.lower().find(b"content-length:")
        if i < 0:
            raise RuntimeError(f"controller reply must carry Content-Length: got {head[:200]!r}")
        n = int(head[i + 15 : head.index(b"\r\n", i)])
        return status, await self._r.readexactly(n)

    async def post(self, path: str, req: BaseModel, reply: type[R]) -> R:
        """POST a request of the protocol, parse the reply as ``reply`` (as the real
        client does, :mod:`phalanx.client.transport`)."""
        status, data = await self.request(b"POST", path.encode(), req.model_dump_json().encode())
        if status != 200:
            raise RuntimeError(f"POST {path} answered {status}: {data[:300]!r}")
        return reply.model_validate_json(data)

    async def status(self) -> Status:
        _, data = await self.request(b"GET", b"/v1/status")
        return Status.model_validate_json(data)

    def close(self) -> None:
        if self._w is not None:
            self._w.close()


async def _open_all(url: str, token: str, n: int) -> list[Conn]:
    """``n`` connections, each answered once (``GET /healthz``) before the next batch
    opens: a connect returns once the kernel finished the handshake, not once the
    controller accepted it, and thousands at once overflow its accept queue (the
    kernel then resets them when the first request comes)."""
    conns = [Conn(url, token) for _ in range(n)]
    for i in range(0, n, CONNECT_BATCH):
        batch = conns[i : i + CONNECT_BATCH]
        await asyncio.gather(*(c.open() for c in batch))
        await asyncio.gather(*(c.request(b"GET", b"/healthz") for c in batch))
    return conns


class Lists:
    """The member lists of one load worker's replicas. Each simulated replica holds a
    digest and fetches the list (or its difference) when its brief names another, as
    the real client does (:mod:`phalanx.client.members`); a reply is parsed and
    checked once per worker (5,000 replicas in one process cannot each parse 10,000
    members: a real replica parses its own list, on its own host, once per change)."""

    def __init__(self) -> None:
        self.by_digest: dict[str, tuple[QuorumPeer, ...]] = {}
        self.parsed: dict[bytes, tuple[QuorumPeer, ...]] = {}
        self.held: dict[str, str] = {}
        """Replica id -> the digest of the list it holds."""
        self.fetches = 0
        self.reply_bytes = 0
        """The largest quorum reply (a brief) seen."""
        self.gate = asyncio.Semaphore(FETCHES_AT_ONCE)

    async def of(self, conn: Conn, rid: str, brief: QuorumBrief) -> tuple[QuorumPeer, ...]:
        have = self.held.get(rid)
        if have != brief.digest:
            req = MembersReq(
                role=brief.role, quorum_id=brief.quorum_id, digest=brief.digest, have=have
            )
            async with self.gate:
                status, data = await conn.request(
                    b"POST", b"/v1/quorum/members", req.model_dump_json().encode()
                )
            if status != 200:
                raise RuntimeError(f"POST /v1/quorum/members answered {status}: {data[:300]!r}")
            self.fetches += 1
            if data not in self.parsed:
                reply = MembersReply.model_validate_json(data)
                base = self.by_digest.get(reply.base) if reply.base is not None else None
                members = members_of(reply, base)
                if roster_digest(members) != brief.digest:
                    raise RuntimeError(f"member list does not match digest {brief.digest}")
                self.parsed[data] = self.by_digest[brief.digest] = members
            self.held[rid] = brief.digest
        return self.by_digest[brief.digest]


async def _quorum(
    conn: Conn, rid: str, step: int, lists: Lists
) -> tuple[QuorumBrief, tuple[QuorumPeer, ...]]:
    """Ask for the quorum at ``step`` until it is answered (a pending long-poll is
    retried with the same request id, as the real client does), then hold its member
    list (fetched only when the digest changed)."""
    req = QuorumReq(replica_id=rid, step=step, request_id=f"s{step}", wait_s=QUORUM_WAIT_S)
    body = req.model_dump_json().encode()
    while True:
        status, data = await conn.request(b"POST", b"/v1/quorum", body)
        if status != 200:
            raise RuntimeError(f"POST /v1/quorum answered {status}: {data[:300]!r}")
        reply = QuorumReply.model_validate_json(data)
        if reply.quorum is not None:
            lists.reply_bytes = max(lists.reply_bytes, len(data))
            return reply.quorum, await lists.of(conn, rid, reply.quorum)


async def _heartbeat_loop(conn: Conn, rid: str, counter: list[int], phase: float = 0.0) -> None:
    # Real replicas start at unrelated times: spread the heartbeats over the second
    # instead of sending all N at once.
    await asyncio.sleep(phase)
    while True:
        await conn.post("/v1/heartbeat", HeartbeatReq(replica_id=rid, wait_s=1.0), HeartbeatReply)
        counter[0] += 1


class PooledHeartbeats:
    """1 Hz unheld heartbeats (``wait_s = 0``) for many replicas over a pool of
    connections: where the controller cannot hold a connection per replica for its
    heartbeat (its file descriptors). Each replica has a slot in the second
    (:data:`SLOTS` of them) and a connection of the pool; one task sends each slot's
    heartbeats on time, each its own request and write (pipelined on its connection),
    and a reader per connection takes the replies as they come, so that a slow reply
    delays no other heartbeat. (One sleep per slot, not per heartbeat: at N = 10,000 a
    sleep per heartbeat was most of the load generator's CPU.)"""

    def __init__(self, conns: list[Conn], counter: list[int]):
        self.conns, self.counter = conns, counter
        self.slots: list[list[tuple[Conn, bytes]]] = [[] for _ in range(SLOTS)]
        self.added = 0
        self.in_flight = [asyncio.Semaphore(PIPELINED) for _ in conns]

    def add(self, rid: str) -> None:
        i = self.added
        self.added += 1
        body = HeartbeatReq(replica_id=rid, wait_s=0.0).model_dump_json().encode()
        self.slots[i % SLOTS].append((self.conns[i % len(self.conns)], body))

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        readers = [loop.create_task(self._replies(i)) for i in range(len(self.conns))]
        index = {id(c): i for i, c in enumerate(self.conns)}
        start = time.monotonic()
        try:
            for k in itertools.count():
                for conn, body in self.slots[k % SLOTS]:
                    await self.in_flight[index[id(conn)]].acquire()  # a second's worth at most
                    conn.send(b"POST", b"/v1/heartbeat", body)
                for r in readers:
                    if r.done():
                        r.result()  # raises what ended it
                lag = start + (k + 1) / SLOTS - time.monotonic()
                if lag > 0:
                    await asyncio.sleep(lag)
        finally:
            for r in readers:
                r.cancel()

    async def _replies(self, i: int) -> None:
        conn, gate = self.conns[i], self.in_flight[i]
        while True:
            status, data = await conn.response()
            if status != 200:
                raise RuntimeError(f"POST /v1/heartbeat answered {status}: {data[:300]!r}")
            self.counter[0] += 1
            gate.release()


async def _refresh(conns: list[Conn]) -> None:
    """Use each connection once more, opening it again if the controller closed it:
    registering thousands of replicas can take longer than its keep-alive timeout
    (75 s), and an idle connection is closed then."""

    async def one(c: Conn) -> None:
        try:
            await c.request(b"GET", b"/healthz")
        except (OSError, asyncio.IncompleteReadError):
            c.close()
            await c.open()
            await c.request(b"GET", b"/healthz")

    for i in range(0, len(conns), CONNECT_BATCH):
        await asyncio.gather(*(one(c) for c in conns[i : i + CONNECT_BATCH]))


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _run_loop(coro: Any) -> Any:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# -- worker protocol -------------------------------------------------------------
#
# Every load worker (phalanx or torchft) speaks the same protocol with the
# coordinator over a Pipe: it sends ("ready",) once its replicas are
# registered and heartbeating, receives ("go", t0), sends ("warm", cpu_s)
# when all its replicas finished the warm-up rounds, and ("done", samples,
# heartbeats, cpu_s) at the end. A sample is (round, sent, answered) on the
# shared monotonic clock.


@dataclass
class Plan:
    n: int
    rounds: int
    warmup: int
    interval_s: float
    held_heartbeats: bool = True
    """One held heartbeat connection per replica, as the real client; else pooled
    (:func:`_pooled_heartbeats`)."""
    profile: str = ""
    """Write each load worker's cProfile stats here ('' for none)."""


def _phalanx_worker(pipe: Any, url: str, token: str, names: list[str], plan: Plan) -> None:
    prof = None
    if plan.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    try:
        _run_loop(_phalanx_worker_async(pipe, url, token, names, plan))
    except Exception as e:  # said in one line by the coordinator (the row's "error")
        pipe.send(("error", f"{type(e).__name__}: {str(e)[:300]}"))
    finally:
        if prof is not None:
            prof.disable()
            prof.dump_stats(f"{plan.profile}-{os.getpid()}.prof")


async def _phalanx_worker_async(
    pipe: Any, url: str, token: str, names: list[str], plan: Plan
) -> None:
    loop = asyncio.get_running_loop()
    # Every connection first, while the controller is idle: opened once thousands of
    # replicas heartbeat, they would wait on its accept queue for minutes.
    n = len(names)
    pool = n if plan.held_heartbeats else max(8, n // 10)
    reg = await _open_all(url, token, 8)
    hb_conns = await _open_all(url, token, pool)
    q_conns = await _open_all(url, token, n)
    beats = [0]
    rids: list[str] = [""] * n
    pooled = PooledHeartbeats(hb_conns, beats)
    hb_tasks = [] if plan.held_heartbeats else [loop.create_task(pooled.run())]

    async def register(conn: Conn, first: int) -> None:
        # Each replica heartbeats from its registration on, as the real client does
        # (the controller evicts a replica silent for heartbeat_s).
        for i in range(first, n, len(reg)):
            reply = await conn.post(
                "/v1/register", RegisterReq(role=ROLE, name=names[i]), RegisterReply
            )
            rids[i] = reply.replica_id
            if plan.held_heartbeats:
                hb = _heartbeat_loop(hb_conns[i], rids[i], beats, (i % 100) / 100)
                hb_tasks.append(loop.create_task(hb))
            else:
                pooled.add(rids[i])

    await asyncio.gather(*(register(c, i) for i, c in enumerate(reg)))
    for c in reg:
        c.close()
    await _refresh(q_conns)
    lists = Lists()
    pipe.send(("ready",))
    _, t0 = await loop.run_in_executor(None, pipe.recv)
    samples: list[tuple[int, float, float]] = []
    warm_left = [len(rids)]

    async def replica(conn: Conn, rid: str) -> None:
        for r in range(plan.rounds):
            delay = t0 + r * plan.interval_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            sent = time.monotonic()
            brief, members = await _quorum(conn, rid, r, lists)
            answered = time.monotonic()
            if brief.world_size != plan.n or len(members) != plan.n:
                raise RuntimeError(f"round {r}: quorum has {len(members)} members, not {plan.n}")
            samples.append((r, sent, answered))
            if r == plan.warmup - 1:
                warm_left[0] -= 1
                if warm_left[0] == 0:
                    pipe.send(("warm", _cpu_s(), beats[0]))

    await asyncio.gather(*(replica(c, rid) for c, rid in zip(q_conns, rids, strict=True)))
    pipe.send(("done", samples, beats[0], _cpu_s(), lists.fetches, lists.reply_bytes))
    # Heartbeat on until the coordinator has read the controller's figures: closing
    # a held connection suspects its replica (that is the point of holding it), and
    # the evictions that follow are the teardown's, not the run's.
    await loop.run_in_executor(None, pipe.recv)
    for t in hb_tasks:
        t.cancel()
    await asyncio.gather(*hb_tasks, return_exceptions=True)
    for c in hb_conns + q_conns:
        c.close()


def _torchft_worker(pipe: Any, addr: str, names: list[str], plan: Plan) -> None:
    from datetime import timedelta

    # One blocking client per replica, each with its own tokio runtime: one
    # runtime thread each keeps 1000 replicas at ~2000 threads. The clients'
    # own logging is not what is measured: keep it to warnings.
    os.environ["TOKIO_WORKER_THREADS"] = "1"
    os.environ["RUST_LOG"] = "warn"
    from torchft._torchft import LighthouseClient

    threading.stack_size(512 * 1024)
    clients = []
    try:
        for _ in names:
            clients.append(LighthouseClient(addr, connect_timeout=timedelta(seconds=30)))
    except Exception as e:  # where the lighthouse arm stops (said in the row)
        pipe.send(("error", f"client {len(clients) + 1} of {len(names)} in a worker: {e}"))
        return
    for c, rid in zip(clients, names, strict=True):
        c.heartbeat(rid)
    stop = threading.Event()
    beats = [0] * HEARTBEAT_THREADS

    def heartbeats(k: int) -> None:
        # This thread's share of the replicas, each once a second, spread over the
        # second. Several threads, so that one slow call (GIL contention with the
        # quorum threads) does not hold up the rest.
        mine = list(zip(clients, names, strict=True))[k::HEARTBEAT_THREADS]
        while mine and not stop.is_set():
            start = time.monotonic()
            for i, (c, rid) in enumerate(mine):
                if stop.is_set():
                    return
                c.heartbeat(rid)
                beats[k] += 1
                lag = start + (i + 1) / len(mine) - time.monotonic()
                if lag > 0:
                    time.sleep(lag)

    hbs = [
        threading.Thread(target=heartbeats, args=(k,), daemon=True)
        for k in range(HEARTBEAT_THREADS)
    ]
    for hb in hbs:
        hb.start()
    pipe.send(("ready",))
    _, t0 = pipe.recv()
    samples: list[tuple[int, float, float]] = []
    lock = threading.Lock()
    warm_left = [len(names)]
    errors: list[BaseException] = []

    def replica(c: Any, rid: str) -> None:
        try:
            for r in range(plan.rounds):
                delay = t0 + r * plan.interval_s - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                sent = time.monotonic()
                q = c.quorum(replica_id=rid, timeout=timedelta(seconds=60), step=r)
                answered = time.monotonic()
                if len(q.participants) != plan.n:
                    raise RuntimeError(f"round {r}: quorum has {len(q.participants)} members")
                samples.append((r, sent, answered))
                if r == plan.warmup - 1:
                    with lock:
                        warm_left[0] -= 1
                        if warm_left[0] == 0:
                            pipe.send(("warm", _cpu_s(), sum(beats)))
        except BaseException as e:
            errors.append(e)

    threads = [
        threading.Thread(target=replica, args=(c, rid), daemon=True)
        for c, rid in zip(clients, names, strict=True)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu = _cpu_s()
    stop.set()
    for hb in hbs:
        hb.join(timeout=5)
    if errors:
        pipe.send(("error", repr(errors[0])))
        return
    pipe.send(("done", samples, sum(beats), cpu))


def _expect(pipe: Any, kind: str, timeout: float) -> tuple[Any, ...]:
    if not pipe.poll(timeout):
        raise TimeoutError(f"a load worker sent no {kind!r} within {timeout:.0f}s")
    msg = pipe.recv()
    if msg[0] == "error":
        raise RuntimeError(f"a load worker failed: {msg[1]}")
    if msg[0] != kind:
        raise RuntimeError(f"a load worker must send {kind!r}: got {msg!r}")
    return msg


@dataclass
class Load:
    samples: list[tuple[int, float, float]]
    heartbeats: int
    loadgen_cpu_s: float
    window_s: float
    fetches: int = 0
    """Member lists the replicas fetched (phalanx), over the whole run."""
    reply_bytes: int = 0
    """The largest quorum reply (phalanx)."""


def _drive(
    target: Callable[..., None],
    worker_args: list[tuple[Any, ...]],
    on_warm: Callable[[], None],
    on_done: Callable[[], None],
    timeout_s: float,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> Load:
    """Run the load workers through ready / go / warm / done (see above)."""
    ctx = mp.get_context("spawn")
    pipes, procs = [], []
    try:
        for args in worker_args:
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=target, args=(theirs, *args), daemon=True)
            p.start()
            pipes.append(mine)
            procs.append(p)
        for pipe in pipes:
            _expect(pipe, "ready", ready_timeout_s)
        t0 = time.monotonic() + 0.5
        for pipe in pipes:
            pipe.send(("go", t0))
        warm = [_expect(pipe, "warm", timeout_s) for pipe in pipes]
        on_warm()
        cpu0 = _cpu_of(procs)
        w0 = time.monotonic()
        done = [_expect(pipe, "done", timeout_s) for pipe in pipes]
        on_done()
        cpu1 = _cpu_of(procs)
        window = time.monotonic() - w0
        for pipe in pipes:
            pipe.send(("stop",))  # a phalanx worker ends its heartbeats now
        for p in procs:
            p.join(timeout=30)
        return Load(
            samples=[s for d in done for s in d[1]],
            heartbeats=sum(d[2] for d in done) - sum(w[2] for w in warm),
            loadgen_cpu_s=cpu1 - cpu0,
            window_s=window,
            fetches=sum(d[4] for d in done if len(d) > 4),
            reply_bytes=max((d[5] for d in done if len(d) > 5), default=0),
        )
    finally:
        for p in procs:
            if p.is_alive() and p.pid is not None:
                os.kill(p.pid, signal.SIGKILL)
                p.join(timeout=5)


def _cpu_of(procs: list[Any]) -> float:
    """CPU seconds the load workers used so far (the same window for all of them:
    each worker's own figure starts when it is warm, the first long before the last)."""
    total = 0.0
    for p in procs:
        try:
            t = psutil.Process(p.pid).cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _summarize(load: Load, warmup: int) -> dict[str, float]:
    lat = [(a - s) * 1e3 for r, s, a in load.samples if r >= warmup]
    rounds: dict[int, tuple[float, float]] = {}
    for r, s, a in load.samples:
        if r >= warmup:
            lo, hi = rounds.get(r, (s, a))
            rounds[r] = (min(lo, s), max(hi, a))
    round_ms = [(hi - lo) * 1e3 for lo, hi in rounds.values()]
    return {
        "quorum_p50_ms": round(_percentile(lat, 50), 2),
        "quorum_p99_ms": round(_percentile(lat, 99), 2),
        "round_ms_p50": round(_percentile(round_ms, 50), 2),
        "round_ms_max": round(max(round_ms), 2),
    }


def _split(names: list[str], workers: int) -> list[list[str]]:
    return [names[i::workers] for i in range(workers) if names[i::workers]]


# -- phalanx ---------------------------------------------------------------------


@dataclass
class Controller:
    url: str
    token: str
    pid: int

    def get(self, path: str) -> httpx.Response:
        r = httpx.get(
            self.url + path, headers={"Authorization": f"Bearer {self.token}"}, timeout=60
        )
        r.raise_for_status()
        return r

    def heartbeats_total(self) -> float:
        for line in self.get("/metrics").text.splitlines():
            if line.startswith("phalanx_heartbeats_total "):
                return float(line.split()[1])
        raise RuntimeError("controller /metrics must expose phalanx_heartbeats_total")

    def evictions_total(self) -> int:
        return int(self.metric("phalanx_evictions_total"))

    def metric(self, name: str) -> float:
        """The sum of ``name``'s samples on ``/metrics`` (every label set)."""
        lines = self.get("/metrics").text.splitlines()
        return sum(float(x.split()[-1]) for x in lines if x.startswith((name + " ", name + "{")))


@contextlib.contextmanager
def controller(
    tmp: Path, name: str, n_init: int, profile_dir: Path | None = None, journal: str = "sqlite"
) -> Iterator[Controller]:
    """A real controller subprocess on port 0, stopped by its pid on exit. ``journal``:
    ``sqlite``, or an etcd URL (a fresh prefix under it per controller)."""
    state = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tmp))  # (one per run of a name)
    cfg = state / "job.toml"
    if journal != "sqlite":
        journal = f"{journal.rstrip('/')}/{name}-{os.getpid()}-{time.time_ns()}"
    # join_timeout_s: a round waits for every live replica (all N here) unless one
    # is this late. The default 1 s would cut a round at N = 1000 short on a busy
    # 2-core machine; 60 s is also torchft's documented lighthouse join timeout.
    # max_connections (uvicorn's limit_concurrency): each replica holds two connections
    # (heartbeat, quorum request), and uvicorn counts a finished request's task until
    # its done-callback runs: when a round's N replies go out and the N next requests
    # come in at once, it briefly counts twice as many tasks as connections.
    cfg.write_text(
        f'[job]\nid = "{name}"\n\n[roles.{ROLE}]\nmin_replicas = 1\n'
        f"n_init_replicas = {n_init}\njoin_timeout_s = {JOIN_TIMEOUT_S}\n\n"
        f'[controller]\njournal = "{journal}"\n'
        f"max_connections = {max(8192, 4 * n_init + FD_MARGIN)}\n"
    )
    log = (state / "controller.log").open("wb")
    cmd = [sys.executable, "-m", "phalanx.cli", "controller", "--state-dir", str(state)]
    if profile_dir is not None:
        profile_dir.mkdir(parents=True, exist_ok=True)
        cmd[1:1] = ["-m", "cProfile", "-o", str(profile_dir / f"{name}.prof")]
    proc = subprocess.Popen(
        [*cmd, "--config", str(cfg), "--port", "0"], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        deadline = time.monotonic() + 60
        while not (state / "url").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (state / "controller.log").read_text()[-2000:]
                raise RuntimeError(f"controller did not start (rc {proc.returncode}):\n{tail}")
            time.sleep(0.05)
        ctl = Controller(
            (state / "url").read_text().strip(), (state / "token").read_text().strip(), proc.pid
        )
        while True:
            try:
                httpx.get(ctl.url + "/healthz", timeout=5).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield ctl
    finally:
        if proc.poll() is None:
            # uvicorn re-raises SIGTERM after its clean shutdown, which would kill a
            # cProfile run before it writes; SIGINT ends in a KeyboardInterrupt.
            proc.send_signal(signal.SIGTERM if profile_dir is None else signal.SIGINT)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def bench_phalanx(
    tmp: Path, plan: Plan, workers: int, profile_dir: Path | None = None, journal: str = "sqlite"
) -> dict[str, Any]:
    with controller(tmp, f"bench-n{plan.n}", plan.n, profile_dir, journal) as ctl:
        cpu = psutil.Process(ctl.pid)
        marks: dict[str, tuple[float, float, float]] = {}
        evictions: dict[str, int] = {}

        def mark(key: str) -> Callable[[], None]:
            def f() -> None:
                t = cpu.cpu_times()
                marks[key] = (time.monotonic(), t.user + t.system, ctl.heartbeats_total())
                evictions[key] = ctl.evictions_total()

            return f

        names = [f"r{i:04d}" for i in range(plan.n)]
        load = _drive(
            _phalanx_worker,
            [(ctl.url, ctl.token, chunk, plan) for chunk in _split(names, workers)],
            mark("warm"),
            mark("done"),
            timeout_s=DRIVE_TIMEOUT_S,
        )
        served = ctl.metric("phalanx_quorum_member_lists_total")
        quorum_ids = ctl.metric("phalanx_quorum_id")
    (t_a, c_a, h_a), (t_b, c_b, h_b) = marks["warm"], marks["done"]
    return {
        **_summarize(load, plan.warmup),
        "heartbeats_per_s": round((h_b - h_a) / (t_b - t_a), 1),
        "heartbeat_mode": "held" if plan.held_heartbeats else "pooled",
        "controller_cpu_percent": round(100 * (c_b - c_a) / (t_b - t_a), 1),
        "loadgen_cpu_percent": round(100 * load.loadgen_cpu_s / load.window_s, 1),
        "evictions": evictions["done"],
        "quorum_reply_bytes": load.reply_bytes,
        "quorum_ids": int(quorum_ids),
        "member_lists_fetched": load.fetches,
        "member_lists_served": int(served),
    }


# -- torchft ---------------------------------------------------------------------


def _lighthouse(pipe: Any, n: int, log_path: str) -> None:
    # The lighthouse logs every quorum request at INFO (its default level):
    # into a file, as a deployed one would, not onto the terminal.
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)
    from torchft._torchft import LighthouseServer

    # Timing knobs left to the binding's defaults (join_timeout_ms=100,
    # quorum_tick_ms=100, heartbeat_timeout_ms=5000 in torchft 0.2.0).
    lh = LighthouseServer(bind="[::]:0", min_replicas=n)
    pipe.send(lh.address())
    pipe.recv()
    lh.shutdown()


def torchft_version() -> str | None:
    try:
        from importlib.metadata import version

        import torchft._torchft  # noqa: F401
    except ImportError:
        return None
    return version("torchft")


def bench_torchft(tmp: Path, plan: Plan, workers: int, timeout_s: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    log = str(tmp / f"lighthouse-n{plan.n}.log")
    server = ctx.Process(target=_lighthouse, args=(theirs, plan.n, log), daemon=True)
    server.start()
    try:
        addr = _expect_value(mine, 60)
        cpu = psutil.Process(server.pid)
        marks: dict[str, tuple[float, float]] = {}

        def mark(key: str) -> Callable[[], None]:
            def f() -> None:
                t = cpu.cpu_times()
                marks[key] = (time.monotonic(), t.user + t.system)

            return f

        names = [f"r{i:04d}" for i in range(plan.n)]
        load = _drive(
            _torchft_worker,
            [(addr, chunk, plan) for chunk in _split(names, workers)],
            mark("warm"),
            mark("done"),
            timeout_s=timeout_s,
            ready_timeout_s=timeout_s,
        )
        mine.send("stop")
        server.join(timeout=10)
    finally:
        if server.is_alive() and server.pid is not None:
            os.kill(server.pid, signal.SIGKILL)
            server.join(timeout=5)
    (t_a, c_a), (t_b, c_b) = marks["warm"], marks["done"]
    s = _summarize(load, plan.warmup)
    return {
        "torchft_quorum_p50_ms": s["quorum_p50_ms"],
        "torchft_quorum_p99_ms": s["quorum_p99_ms"],
        "torchft_round_ms_p50": s["round_ms_p50"],
        "torchft_round_ms_max": s["round_ms_max"],
        "torchft_heartbeats_per_s": round(load.heartbeats / load.window_s, 1),
        "torchft_lighthouse_cpu_percent": round(100 * (c_b - c_a) / (t_b - t_a), 1),
        "torchft_loadgen_cpu_percent": round(100 * load.loadgen_cpu_s / load.window_s, 1),
    }


def _expect_value(pipe: Any, timeout: float) -> Any:
    if not pipe.poll(timeout):
        raise TimeoutError(f"the lighthouse process sent no address within {timeout:.0f}s")
    return pipe.recv()


# -- fast failure detection ------------------------------------------------------


async def _evicted_at(conn: Conn, victim: str) -> float:
    """Poll the status every 5 ms; the time it first no longer lists ``victim``."""
    while True:
        ids = {r.replica_id for r in (await conn.status()).roles[ROLE].replicas}
        if victim not in ids:
            return time.monotonic()
        await asyncio.sleep(0.005)


def _fd_replica(pipe: Any, url: str, token: str, name: str) -> None:
    _run_loop(_fd_replica_async(pipe, url, token, name))


async def _fd_replica_async(pipe: Any, url: str, token: str, name: str) -> None:
    loop = asyncio.get_running_loop()
    conn, hb, status_conn = await _open_all(url, token, 3)
    rid = (
        await conn.post("/v1/register", RegisterReq(role=ROLE, name=name), RegisterReply)
    ).replica_id
    beats = [0]
    hb_task = loop.create_task(_heartbeat_loop(hb, rid, beats))
    lists = Lists()
    pipe.send(("ready", rid, os.getpid()))
    while True:
        msg = await loop.run_in_executor(None, pipe.recv)
        if msg[0] == "quorum":
            _, members = await _quorum(conn, rid, msg[1], lists)
            pipe.send(("quorum", [m.replica_id for m in members]))
        elif msg[0] == "report":
            _, victim, step = msg
            sent = time.monotonic()
            report = ReportReq(reporter=rid, suspects=[victim], reason="bench: collective error")
            await conn.post("/v1/report-failure", report, ReportReply)
            t_evict, (_, members) = await asyncio.gather(
                _evicted_at(status_conn, victim), _quorum(conn, rid, step, lists)
            )
            t_quorum = time.monotonic()
            ids = [m.replica_id for m in members]
            pipe.send(("reported", t_evict - sent, t_quorum - sent, ids))
        else:
            break
    hb_task.cancel()


def bench_failure_detection(tmp: Path, trial: int, k: int = 3) -> dict[str, Any]:
    """K replica processes in quorum; SIGKILL one; a survivor reports it."""
    ctx = mp.get_context("spawn")
    with controller(tmp, f"bench-fd{trial}", k) as ctl:
        pipes, procs, rids, pids = [], [], [], []
        try:
            for i in range(k):
                mine, theirs = ctx.Pipe()
                p = ctx.Process(target=_fd_replica, args=(theirs, ctl.url, ctl.token, f"fd{i}"))
                p.start()
                pipes.append(mine)
                procs.append(p)
            for pipe in pipes:
                _, rid, pid = _expect(pipe, "ready", 60)
                rids.append(rid)
                pids.append(pid)
            for pipe in pipes:
                pipe.send(("quorum", 0))
            for pipe in pipes:
                assert len(_expect(pipe, "quorum", 60)[1]) == k
            victim = rids[-1]
            os.kill(pids[-1], signal.SIGKILL)
            procs[-1].join(timeout=10)
            for pipe in pipes[1:-1]:
                pipe.send(("quorum", 1))  # survivors that saw the error ask again
            pipes[0].send(("report", victim, 1))
            _, evict_s, requorum_s, members = _expect(pipes[0], "reported", 60)
            for pipe in pipes[1:-1]:
                _expect(pipe, "quorum", 60)
            if victim in members or len(members) != k - 1:
                raise RuntimeError(f"the quorum after the report must drop {victim}: {members}")
            events = Status.model_validate_json(ctl.get("/v1/status").content).events
            rep = next(e for e in reversed(events) if e.kind == "failure_report")
            ev = next(
                e for e in events if e.kind == "evict" and getattr(e, "replica_id", "") == victim
            )
            for pipe in pipes[:-1]:
                pipe.send(("stop",))
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive() and p.pid is not None:
                    os.kill(p.pid, signal.SIGKILL)
                    p.join(timeout=5)
    return {
        "evict_after_report_ms": round(evict_s * 1e3, 1),
        "evict_after_report_controller_ms": round((ev.at - rep.at) * 1e3, 1),
        "requorum_after_report_ms": round(requorum_s * 1e3, 1),
    }


# -- main ------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--n", default="10,100,1000", help="replica counts (comma separated)")
    p.add_argument(
        "--rounds",
        type=int,
        help="quorum rounds per N, warm-up included (default: 12, and 6 at N = 1000)",
    )
    p.add_argument("--warmup", type=int, default=2, help="warm-up rounds left out of the figures")
    p.add_argument("--interval-s", type=float, default=0.5, help="round period (a training step)")
    p.add_argument("--workers", type=int, default=2, help="load worker processes (N >= 100)")
    p.add_argument("--fd-trials", type=int, default=3, help="failure-detection trials")
    p.add_argument("--no-torchft", action="store_true", help="skip the torchft comparison")
    p.add_argument(
        "--profile-dir",
        type=Path,
        help="run the controller and the load workers under cProfile, stats into this dir",
    )
    p.add_argument(
        "--heartbeats",
        choices=("auto", "held", "pooled"),
        default="auto",
        help="held: a held heartbeat connection per replica, as the real client; pooled: "
        "1 Hz unheld heartbeats over N/10 connections; auto: held where the controller's "
        "file descriptors allow 2N connections",
    )
    p.add_argument(
        "--torchft-timeout-s",
        type=float,
        default=300.0,
        help="give up the torchft arm (and say where it stopped) after this long per phase",
    )
    p.add_argument(
        "--journal",
        default="sqlite",
        help="the controllers' controller.journal: sqlite, or etcd://HOST:PORT of a running etcd",
    )
    p.add_argument(
        "--etcd-ratio",
        type=int,
        default=0,
        metavar="PAIRS",
        help="then etcd_quorum_ratio: PAIRS runs at N = 100 of each journal, alternating "
        "(SQLite, then a local etcd this bench starts), the ratio of their medians",
    )
    args = p.parse_args(argv)
    if args.rounds is not None and not 0 < args.warmup < args.rounds:
        p.error(f"--warmup must be in [1, --rounds): got {args.warmup} with --rounds {args.rounds}")
    tf_version = None if args.no_torchft else torchft_version()
    out = sys.stdout
    rows = []
    with tempfile.TemporaryDirectory(prefix="phalanx-bench-") as d:
        tmp = Path(d)
        for n in (int(x) for x in args.n.split(",")):
            rounds = args.rounds or max(args.warmup + 4, min(12, 6000 // n))
            held = args.heartbeats == "held" or (
                args.heartbeats == "auto" and 2 * n + FD_MARGIN <= _fd_limit()
            )
            profile = str(args.profile_dir / f"loadgen-n{n}") if args.profile_dir else ""
            if args.profile_dir:
                args.profile_dir.mkdir(parents=True, exist_ok=True)
            plan = Plan(n, rounds, args.warmup, args.interval_s, held, profile)
            workers = 1 if n < 100 else args.workers
            row: dict[str, Any] = {
                "n": n,
                "rounds": rounds - args.warmup,
                "warmup_rounds": args.warmup,
                "interval_s": args.interval_s,
                "load_workers": workers,
                # Other tenants' load on this (shared) machine when this N started.
                "loadavg_1m": round(os.getloadavg()[0], 2),
            }
            try:
                row.update(bench_phalanx(tmp, plan, workers, args.profile_dir, args.journal))
            except Exception as e:  # a row that says why, and the next N
                row.update(quorum_p50_ms=None, error=f"phalanx run failed at N={n}: {e}")
            row["journal"] = args.journal.split("://")[0]
            row.update(torchft_fields(tmp, plan, workers, tf_version, args.torchft_timeout_s))
            ours, theirs = row["quorum_p50_ms"], row.get("torchft_quorum_p50_ms")
            row["ratio_vs_torchft"] = round(ours / theirs, 2) if ours and theirs else None
            rows.append(row)
            if args.json:
                print(json.dumps(row), file=out, flush=True)
        if args.etcd_ratio:
            ratio = etcd_ratio(tmp, args.etcd_ratio, args.warmup, args.interval_s)
            if args.json:
                print(json.dumps(ratio), file=out, flush=True)
            else:
                print(f"etcd_quorum_ratio {ratio['etcd_quorum_ratio']} (goal <= 1.2): {ratio}")
        trials = [bench_failure_detection(tmp, i) for i in range(args.fd_trials)]
    fd = {
        "failure_detection": {
            "k": 3,
            "trials": args.fd_trials,
            **{key: _median([t[key] for t in trials]) for key in trials[0]},
            "evict_after_report_ms_all": [t["evict_after_report_ms"] for t in trials],
            "suspect_grace_s": 0.25,
            "target_ms": 500,
        }
    }
    if args.json:
        print(json.dumps(fd), file=out, flush=True)
    else:
        _table(rows, fd["failure_detection"])
    return 0


def etcd_ratio(tmp: Path, pairs: int, warmup: int, interval_s: float) -> dict[str, Any]:
    """``etcd_quorum_ratio``: quorum p50 at N = 100 with the etcd journal over SQLite's,
    the median of ``pairs`` runs of each, alternating (the machine's load moves between
    runs more than the arms differ). The etcd is a local member this bench starts, as
    ``phalanx run --journal etcd`` does."""
    from phalanx.launch.controllers.etcd import LocalEtcd

    etcd = LocalEtcd(tmp / "etcd-ratio")
    try:
        url = etcd.start()
        runs: dict[str, list[float]] = {"sqlite": [], "etcd": []}
        plan = Plan(100, warmup + 8, warmup, interval_s, True, "")
        for _ in range(pairs):
            for arm, journal in (("sqlite", "sqlite"), ("etcd", url)):
                row = bench_phalanx(tmp, plan, 2, None, journal)
                runs[arm].append(row["quorum_p50_ms"])
    finally:
        etcd.stop()
    sqlite_ms, etcd_ms = _median(runs["sqlite"]), _median(runs["etcd"])
    return {
        "n": 100,
        "etcd_quorum_ratio": round(etcd_ms / sqlite_ms, 3),
        "goal": 1.2,
        "sqlite_quorum_p50_ms": sqlite_ms,
        "etcd_quorum_p50_ms": etcd_ms,
        "sqlite_runs_ms": runs["sqlite"],
        "etcd_runs_ms": runs["etcd"],
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def _fd_limit() -> int:
    """File descriptors the controller (a child of this process) may open."""
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def torchft_fields(
    tmp: Path, plan: Plan, workers: int, version: str | None, timeout_s: float
) -> dict[str, Any]:
    empty = {
        "torchft_quorum_p50_ms": None,
        "torchft_quorum_p99_ms": None,
        "torchft_round_ms_p50": None,
        "torchft_version": version,
    }
    if version is None:
        return {**empty, "torchft_reason": "skipped, or torchft is not installed"}
    try:
        return {**bench_torchft(tmp, plan, workers, timeout_s), "torchft_version": version}
    except Exception as e:
        why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return {**empty, "torchft_reason": f"torchft run failed at N={plan.n}: {why}"}


def _median(xs: list[float]) -> float:
    return round(_percentile(xs, 50), 1)


def _table(rows: list[dict[str, Any]], fd: dict[str, Any]) -> None:
    cols = [
        ("n", "N"),
        ("quorum_p50_ms", "p50 ms"),
        ("quorum_p99_ms", "p99 ms"),
        ("round_ms_p50", "round ms"),
        ("heartbeats_per_s", "hb/s"),
        ("controller_cpu_percent", "ctl cpu%"),
        ("torchft_quorum_p50_ms", "tf p50"),
        ("torchft_quorum_p99_ms", "tf p99"),
        ("torchft_round_ms_p50", "tf round"),
        ("ratio_vs_torchft", "ours/tf"),
    ]
    print(" ".join(f"{h:>9}" for _, h in cols))
    for r in rows:
        print(" ".join(f"{'-' if r.get(k) is None else r[k]!s:>9}" for k, _ in cols))
    print(
        f"\nfailure detection (K=3, {fd['trials']} trials): evict {fd['evict_after_report_ms']} ms "
        f"after the report (controller: {fd['evict_after_report_controller_ms']} ms), survivors' "
        f"new quorum {fd['requorum_after_report_ms']} ms after it"
    )
    print(f"{platform.node()}: {os.cpu_count()} CPUs, python {platform.python_version()}")


if __name__ == "__main__":
    sys.exit(main())

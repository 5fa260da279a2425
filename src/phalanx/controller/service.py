"""The controller service: the pure core, its journal, the payload log, and the
waiters of long-polls, glued together on one asyncio loop.

Every mutation goes through :meth:`ControllerService.apply`, which runs the
core call, writes the payloads it accepted to the payload log, writes the
resulting changes to the journal, and only then drops the payloads it let go
and wakes the long-polls that the call answered. So no reply ever tells a
replica something the journal does not hold yet, and no journaled record
refers to a payload that was not written first. While the journal cannot take a
write (an etcd without quorum), :mod:`phalanx.controller.outbox` holds the
changes, answers 503 and retries; with etcd it also batches the writes of
concurrent requests (:meth:`ControllerService.acknowledged`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from phalanx.config import JobConfig
from phalanx.controller.core import shapes
from phalanx.controller.core.state import ControllerState, Tick
from phalanx.controller.journal.base import Journal
from phalanx.controller.metrics import Metrics
from phalanx.controller.outbox import NotAcknowledged, Outbox
from phalanx.controller.payloads import PayloadLog
from phalanx.controller.replay_writer import open_writer
from phalanx.controller.statedir import CannotStart
from phalanx.net import connect
from phalanx.protocol.status import Status
from phalanx.transport.base import store_name

if TYPE_CHECKING:
    from phalanx.controller.collector import Collector

log = logging.getLogger("phalanx.controller")

PROBE_EVERY_S = 0.02
"""How often the controller connects again to a suspect's address that accepted."""
WAITS = ("quorum", "heartbeat", "lifeline", "commands", "ledger", "status")
"""Kinds of long-poll a request may wait on (:meth:`ControllerService.wait`)."""


class ControllerService:
    def __init__(
        self,
        cfg: JobConfig,
        journal: Journal,
        payloads: PayloadLog,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        collector: Collector | None = None,
        check_addresses: bool = False,
    ):
        self.cfg = cfg
        self.check_addresses = check_addresses
        """Connect to each registering replica's address first (a controller that
        serves beyond loopback, so replicas on other hosts: a typo in an advertised
        address is refused at once, in one line)."""
        self.journal = journal
        self.payloads = payloads
        self.clock = clock
        self.wall = wall
        self.collector = collector
        """Drops payloads from a rollout store outside the controller (None: the
        controller's own payload log is the store)."""
        payloads.load()
        tables = journal.load()
        try:
            shapes.check(tables)
        except shapes.BadRecord as e:
            fix = (
                "start with --fresh to set it aside"
                if journal.kind == "sqlite"
                else "delete its prefix (etcdctl del --prefix)"
            )
            raise CannotStart(
                f"journal {journal.where} is damaged: {e}. Restore the journal from a backup, "
                f"or {fix} and begin the job again at epoch 1."
            ) from None
        self.state = ControllerState.restore(
            cfg,
            tables,
            clock(),
            run=uuid.uuid4().hex[:12],
            payload_of=payloads.get,
        )
        payloads.put(self.state.moved)
        self.state.moved = []
        dropped = payloads.retain(self.state.payload_keys())
        if dropped:
            log.info("payload log: %d payload(s) no journal record refers to were dropped", dropped)
        self.state.start(clock(), wall())
        self.replay = open_writer(cfg, self.state.ledger, payloads.get)
        """Writes trained rollouts to a Redis replay (None: no Redis replay)."""
        self._replay_task: asyncio.Task[None] | None = None
        self.metrics = Metrics(self)
        self.outbox = Outbox(journal, wall, self._act, self.metrics.journal_writes.inc)
        """The journal write of every call, and what happens while the journal is down."""
        self._waiters: dict[str, dict[str, list[asyncio.Future[bool]]]] = {k: {} for k in WAITS}
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop the service runs on (set by :meth:`start`)."""
        self._ticker: asyncio.Task[None] | None = None
        self._probes: set[asyncio.Task[None]] = set()
        """Connections to suspects' addresses in flight (:meth:`_probe_address`)."""
        self.apply(self.state.reconcile)

    @property
    def epoch(self) -> int:
        return self.state.epoch

    def envelope(self) -> dict[str, Any]:
        """The fields every reply carries."""
        return {"epoch": self.state.epoch, "job_id": self.cfg.job.id}

    def apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one core call with the current clocks, make its payloads and changes
        durable, then act on its :class:`Tick`. The call's own return value is
        passed through (with the Tick peeled off where it returns one)."""
        result: Any = fn(*args, now=self.clock(), wall=self.wall(), **kwargs)
        tick: Tick | None = None
        if isinstance(result, Tick):
            tick, result = result, None
        elif isinstance(result, tuple) and result and isinstance(result[-1], Tick):
            tick = result[-1]
            result = result[0] if len(result) == 2 else result[:-1]
        self.commit(tick)
        return result

    def commit(self, tick: Tick | None = None) -> None:
        """Journal the core's changes since the last commit (at once, or in the next
        group commit), then act on ``tick`` once they are durable. Raises
        :class:`NotAcknowledged` (503) while the journal is unavailable: they are held
        and written again (:mod:`phalanx.controller.outbox`)."""
        if tick is not None and tick.puts:
            self.payloads.put(tick.puts)  # before the journal: no record without its payload
        self.outbox.commit(self.state.drain(), tick)

    def apply_quietly(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        """:meth:`apply` for the calls no request waits on (the ticker, probes, the
        replay writer, the collector): while the journal is down their changes are
        held and written with the rest, and nobody is told of them before."""
        try:
            self.apply(fn, *args, **kwargs)
        except NotAcknowledged:
            pass

    async def acknowledged(self) -> None:
        """Return once every change made so far is journaled, or raise
        :class:`NotAcknowledged` (503). Every route awaits it before it replies, so no
        reply carries what the journal does not hold (a long-poll woken by, or
        reading, state made in memory only)."""
        await self.outbox.acknowledged()

    def status(self) -> Status:
        """The status document, with the journal's health."""
        st = self.state.status(self.clock(), self.wall())
        update = {"journal": self.outbox.health(), "controllers": self.journal.controllers()}
        return st.model_copy(update=update)

    def _act(self, ticks: list[Tick], wrote: bool) -> None:
        """Act on ticks whose changes are durable, in order (``wrote``: a batch was
        committed, so the status changed)."""
        if wrote:
            for key in list(self._waiters["status"]):
                self._wake("status", key)
        led = self.state.ledger
        if self.replay is not None and led is not None and led.replay.out:
            self.replay.wake.set()
        for tick in ticks:
            self._act_on(tick)

    def _act_on(self, tick: Tick) -> None:
        if tick.drops:
            self.payloads.drop(tick.drops)
        if tick.sweeps and self.collector is not None:
            self.collector.submit(tick.sweeps)
        for q in tick.formed:
            self.metrics.quorums.labels(q.role).inc()
            for rid in q.replica_ids:
                self._wake("quorum", rid)
        for rid in tick.evicted:
            ev: dict[str, Any] = next(
                (e for e in reversed(self.state.events) if e.get("replica_id") == rid), {}
            )
            self.metrics.evictions.labels(ev.get("role", "?"), ev.get("reason", "?")).inc()
            self.metrics.evictions_by_detector.labels(
                ev.get("role", "?"), ev.get("detector", "?")
            ).inc()
            for kind in ("quorum", "heartbeat", "lifeline", "commands", "ledger"):
                self._wake(kind, rid)
        for rid in tick.probe:
            self._wake("heartbeat", rid)
            self._probe_address(rid)
        for rid in tick.commands_for:
            self._wake("commands", rid)
        for rid in tick.ledger_for:
            self._wake("ledger", rid)

    def _probe_address(self, rid: str) -> None:
        """Besides asking a suspect to heartbeat, connect to its address (its
        rendezvous store, served for the replica's whole life): a refusal means
        its process is gone (a SIGKILLed replica's held connection dropped), and
        it is evicted at once rather than after ``suspect_grace_s``. No answer
        (a partition) leaves the grace to decide; a connection is tried again
        every :data:`PROBE_EVERY_S` while the suspicion lasts (a dying process
        may drop its held connection a moment before its store's listener)."""
        m = self.state.members.get(rid)
        if m is None or not m.address or not self.cfg.timeouts.probe_address:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a restore): the grace decides
            return
        task = loop.create_task(self._connect(rid, m.address))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _connect(self, rid: str, address: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.timeouts.suspect_grace_s
        while True:
            try:
                await connect(address, max(0.0, deadline - loop.time()))
            except ConnectionRefusedError:
                self.apply_quietly(self.state.refused, rid)
                return
            except (OSError, ValueError, TimeoutError):
                return
            m = self.state.members.get(rid)
            if m is None or m.suspect_since is None or loop.time() + PROBE_EVERY_S > deadline:
                return
            await asyncio.sleep(PROBE_EVERY_S)

    def _wake(self, kind: str, key: str) -> None:
        for fut in self._waiters[kind].pop(key, []):
            if not fut.done():
                fut.set_result(True)

    def release_held(self) -> None:
        """Wake every held request (heartbeats, lifelines, long-polls) now, from any
        thread: a server that stops answers them before its graceful shutdown ends,
        rather than having them cancelled mid-wait."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def release() -> None:
            for waiters in self._waiters.values():
                for futs in list(waiters.values()):
                    for fut in futs:
                        if not fut.done():
                            fut.set_result(False)

        loop.call_soon_threadsafe(release)

    async def wait(self, kind: str, key: str, timeout: float) -> bool:
        """Wait until ``key`` (a replica id; a stream's own key for ``status``) is woken
        for ``kind`` or ``timeout`` passes. Returns True when woken. A future and a
        timer, no task: every held heartbeat waits here, 10,000 a second at N =
        10,000 (``asyncio.wait_for`` cost several times more)."""
        waiters = self._waiters[kind]
        if timeout <= 0:
            return False
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        waiters.setdefault(key, []).append(fut)
        timer = loop.call_later(timeout, _time_out, fut)
        try:
            return await fut
        finally:
            timer.cancel()
            lst = waiters.get(key)
            if lst is not None and fut in lst:
                lst.remove(fut)
                if not lst:
                    del waiters[key]

    async def run_ticker(self) -> None:
        period = self.cfg.controller.tick_s
        while True:
            await asyncio.sleep(period)
            self.outbox.poll()  # deposed, as the journal found by itself: stop at once
            if not self.outbox.down:  # no deadline is decided that cannot be journaled
                self.apply_quietly(self.state.tick)

    def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        self._ticker = loop.create_task(self.run_ticker())
        led = self.state.ledger
        if self.replay is not None and led is not None:
            ledger, replay = led, led.replay

            def unreachable(error: str) -> None:
                self.apply_quietly(lambda *, now, wall: replay.unreachable(error, wall))

            def made(ids: list[str], *, now: float, wall: float) -> Tick:
                replay.written(ids)  # their payloads may go now
                return ledger.take(Tick())

            def written(ids: list[str]) -> None:
                self.apply_quietly(made, ids)

            outbox = led.replay.outbox
            self._replay_task = loop.create_task(self.replay.run(outbox, written, unreachable))
            self.replay.wake.set()
        if self.collector is not None:
            led = self.state.ledger

            def swept(refs: list[str]) -> None:
                loop.call_soon_threadsafe(self.apply_quietly, self.state.swept, refs)

            def referenced() -> set[str]:
                if led is None:
                    return set()
                return {r["ref"] for r in led.rollouts.records.values()} | led.replay.refs()

            name = store_name(self.cfg.job.id, led.run if led is not None else "")
            self.collector.start(name, swept, loop, referenced)
            if led is not None and led.unswept:
                self.collector.submit(sorted(led.unswept.items()))

    async def stop(self) -> None:
        await self.outbox.stop()
        for task in list(self._probes):
            task.cancel()
        for loop_task in (self._ticker, self._replay_task):
            if loop_task is None:
                continue
            loop_task.cancel()
            try:
                await loop_task
            except asyncio.CancelledError:
                pass
        if self.replay is not None:
            self.replay.close()
        if self.collector is not None:
            # Drops still queued get a few seconds; the rest stay journaled for the next start.
            await asyncio.get_running_loop().run_in_executor(None, self.collector.stop)
            await asyncio.sleep(0)  # let the collector's last reports apply
        self.journal.close()
        self.payloads.close()


def _time_out(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(False)

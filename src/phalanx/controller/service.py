"""The controller service: the pure state machine, its journal, and the waiters
of long-polls, glued together on one asyncio loop.

Every mutation goes through :meth:`ControllerService.apply`, which runs the
state-machine call, writes the resulting changes to the journal, and only
then wakes the long-polls that the call answered. So no reply ever tells a
replica something the journal does not hold yet.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from phalanx.config import JobConfig
from phalanx.controller.journal import Journal
from phalanx.controller.metrics import Metrics
from phalanx.controller.state import ControllerState, Tick


class ControllerService:
    def __init__(
        self,
        cfg: JobConfig,
        journal: Journal,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ):
        self.cfg = cfg
        self.journal = journal
        self.clock = clock
        self.wall = wall
        self.state = ControllerState.restore(cfg, journal.load(), clock())
        self.state.start(clock(), wall())
        self.journal.write(self.state.drain())
        self.metrics = Metrics(self)
        self._quorum_waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._heartbeat_waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._lifeline_waiters: dict[str, list[asyncio.Future[None]]] = {}
        """Held lifelines: woken (ended) when their replica leaves or is evicted."""
        self._command_waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._ledger_waiters: dict[str, list[asyncio.Future[None]]] = {}
        self._queue_waiters: dict[str, list[asyncio.Future[None]]] = {}
        """Rollout-queue lease long-polls, by queue name."""
        self._status_waiters: dict[str, list[asyncio.Future[None]]] = {}
        """Open dashboards (server-sent events): woken by every journaled change."""
        self._ticker: asyncio.Task[None] | None = None

    @property
    def epoch(self) -> int:
        return self.state.epoch

    def apply(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one state-machine call with the current clocks, journal its changes,
        then wake whoever it answered. The call's own return value is passed
        through (with the :class:`Tick` peeled off where it returns one)."""
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
        changes = self.state.drain()
        if changes:
            self.journal.write(changes)
            self.metrics.journal_writes.inc()
            if self._status_waiters:
                for key in list(self._status_waiters):
                    self._wake(self._status_waiters, key)
        if tick is None:
            return
        for q in tick.formed:
            self.metrics.quorums.labels(q.role).inc()
            for rid in q.replica_ids:
                self._wake(self._quorum_waiters, rid)
        for rid in tick.evicted:
            ev: dict[str, Any] = next(
                (e for e in reversed(self.state.events) if e.get("replica_id") == rid), {}
            )
            self.metrics.evictions.labels(ev.get("role", "?"), ev.get("reason", "?")).inc()
            self.metrics.evictions_by_detector.labels(
                ev.get("role", "?"), ev.get("detector", "?")
            ).inc()
            for waiters in (
                self._quorum_waiters,
                self._heartbeat_waiters,
                self._lifeline_waiters,
                self._command_waiters,
                self._ledger_waiters,
            ):
                self._wake(waiters, rid)
        for rid in tick.probe:
            self._wake(self._heartbeat_waiters, rid)
        for rid in tick.commands_for:
            self._wake(self._command_waiters, rid)
        for rid in tick.ledger_for:
            self._wake(self._ledger_waiters, rid)
        for name in tick.queues:
            self._wake(self._queue_waiters, name)

    @staticmethod
    def _wake(waiters: dict[str, list[asyncio.Future[None]]], rid: str) -> None:
        for fut in waiters.pop(rid, []):
            if not fut.done():
                fut.set_result(None)

    async def wait(self, kind: str, replica_id: str, timeout: float) -> bool:
        """Wait until ``replica_id`` (a queue's name for ``queue``) is woken for ``kind``
        or ``timeout`` passes. Returns True when woken."""
        waiters = {
            "quorum": self._quorum_waiters,
            "heartbeat": self._heartbeat_waiters,
            "lifeline": self._lifeline_waiters,
            "commands": self._command_waiters,
            "ledger": self._ledger_waiters,
            "queue": self._queue_waiters,
            "status": self._status_waiters,
        }[kind]
        if timeout <= 0:
            return False
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters.setdefault(replica_id, []).append(fut)
        try:
            await asyncio.wait_for(fut, timeout)
            return True
        except TimeoutError:
            return False
        finally:
            lst = waiters.get(replica_id)
            if lst is not None and fut in lst:
                lst.remove(fut)
                if not lst:
                    del waiters[replica_id]

    async def run_ticker(self) -> None:
        period = self.cfg.controller.tick_s
        while True:
            await asyncio.sleep(period)
            self.apply(self.state.tick)

    def start(self) -> None:
        self._ticker = asyncio.get_running_loop().create_task(self.run_ticker())

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            try:
                await self._ticker
            except asyncio.CancelledError:
                pass
        self.journal.close()

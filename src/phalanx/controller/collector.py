"""Drops rollout payloads from a store outside the controller (Redis, storage).

The ledger lets a payload go when its rollout is trained or discarded, and
journals the drop (``payload_drops``) in the same transaction; this thread
makes the drop on the store and then tells the core, which deletes the
journal entry. A drop that fails (the store is down) is retried with
backoff; one not made when the controller stops stays journaled and is
made after the next start. So a payload is dropped exactly when nothing
needs it, whatever fails.

It also sweeps *orphans*: payloads no ledger record refers to, older than
``orphan_age_s`` (a rollout replica that died between its put and its
submit). A very late submit of such a ref is accepted by the ledger and
then reported lost by the policy replica that cannot read it: the prompt is
dispatched again, nothing is lost.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable

from phalanx.transport.base import RolloutStore, TransportError, ref_time

log = logging.getLogger("phalanx.controller")

BATCH = 512
"""Refs dropped per store call."""


class Collector:
    def __init__(
        self,
        open_store: Callable[[str], RolloutStore],
        *,
        orphan_age_s: float = 600.0,
        sweep_every_s: float = 60.0,
        stop_timeout_s: float = 5.0,
    ):
        self.open_store = open_store
        """Opens the job's store under its name (the job id and the ledger's run)."""
        self.store: RolloutStore | None = None
        self.orphan_age_s, self.sweep_every_s = orphan_age_s, sweep_every_s
        self.stop_timeout_s = stop_timeout_s
        self._todo: queue.Queue[tuple[str, str]] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._swept: Callable[[list[str]], None] = lambda refs: None
        self._referenced: Callable[[], set[str]] = set
        self._loop: asyncio.AbstractEventLoop | None = None
        self.dropped: dict[str, int] = defaultdict(int)

    def start(
        self,
        name: str,
        swept: Callable[[list[str]], None],
        loop: asyncio.AbstractEventLoop,
        referenced: Callable[[], set[str]],
    ) -> None:
        """Open the store named ``name`` and start. ``swept(refs)`` is called (from this
        thread) after each drop; ``referenced()`` is run on ``loop`` (where the core
        lives) and returns the refs the ledger holds."""
        self.store = self.open_store(name)
        self._swept, self._loop, self._referenced = swept, loop, referenced
        self._thread = threading.Thread(target=self._run, name="phalanx-collector", daemon=True)
        self._thread.start()

    def submit(self, sweeps: list[tuple[str, str]]) -> None:
        for item in sweeps:
            self._todo.put(item)

    def stop(self) -> None:
        """Make the drops already queued (for up to ``stop_timeout_s``), then end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.stop_timeout_s + 5)
        if self.store is not None:
            self.store.close()

    def _run(self) -> None:
        backoff = 0.5
        next_sweep = time.monotonic() + self.sweep_every_s
        stop_by: float | None = None
        while True:
            if self._stop.is_set():
                stop_by = stop_by or time.monotonic() + self.stop_timeout_s
                if self._todo.empty() or time.monotonic() > stop_by:
                    return  # what is left stays journaled: made after the next start
            batch = self._take()
            try:
                if batch:
                    self._drop(batch)
                elif not self._stop.is_set() and time.monotonic() >= next_sweep:
                    next_sweep = time.monotonic() + self.sweep_every_s
                    self._sweep()
                backoff = 0.5
            except (TransportError, TimeoutError) as e:
                log.warning("payload collector: %s; retrying in %.1f s", e, backoff)
                self.submit(batch)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)

    def _take(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        try:
            out.append(self._todo.get(timeout=0.2))
            while len(out) < BATCH:
                out.append(self._todo.get_nowait())
        except queue.Empty:
            pass
        return out

    def _drop(self, batch: list[tuple[str, str]]) -> None:
        by_reason: dict[str, list[str]] = defaultdict(list)
        for ref, reason in batch:
            by_reason[reason].append(ref)
        if self.store is None:
            return
        for reason, refs in by_reason.items():
            self.dropped[reason] += self.store.drop(refs, reason)
            self._swept(refs)

    def _sweep(self) -> None:
        """Drop payloads nothing refers to, older than ``orphan_age_s``."""
        if self.store is None:
            return
        cutoff = time.time() - self.orphan_age_s
        old = [r for r in self.store.refs() if (ref_time(r) or time.time()) < cutoff]
        if not old or self._loop is None:
            return

        async def held() -> set[str]:
            return self._referenced()

        live = asyncio.run_coroutine_threadsafe(held(), self._loop).result(timeout=30)
        orphans = [r for r in old if r not in live]
        if orphans:
            n = self.store.drop(orphans, "orphan")
            self.dropped["orphan"] += n
            log.info("payload collector: %d orphan payload(s) dropped", n)

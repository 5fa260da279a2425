"""What stands between the core's changes and an acknowledgement: the journal write,
batched across requests where the journal is remote, and what the service does while
the journal cannot take one.

:meth:`Outbox.commit` is called by the service after every core call, on its event
loop, with the call's changes and its :class:`~phalanx.controller.core.base.Tick`.
Every route awaits :meth:`Outbox.acknowledged` before it replies. The rule both keep:
**no reply leaves while any change the core has made is not journaled**, so no reply
tells anyone what a restart could lose, and the ticks (wake the long-polls, drop the
payloads) are acted on only once their changes are durable, in order.

Two ways to write, after the journal (:attr:`Journal.group_commit`):

- **at once** (SQLite, tens of microseconds): ``commit`` writes the call's changes
  as one batch before it returns, exactly as before there was an outbox;
- **group commit** (etcd, a network round trip and an fsync on a quorum of
  members): ``commit`` only holds the changes, and one writer task writes
  everything held as one batch, from a worker thread, while the loop goes on
  serving and holding more. A reply waits for the batch that holds every change
  made before it: under load, one etcd transaction acknowledges many requests.

When the journal raises :class:`~phalanx.controller.journal.base.JournalUnavailable`
(an etcd that lost its quorum, or does not answer):

- the changes and ticks stay held, in order; every waiting reply and every new
  request gets a 503 (:class:`NotAcknowledged`) with one line that says why, and
  the client retries it as it would a dropped connection. Nothing acknowledged is
  lost, and nothing unacknowledged is reported as done;
- the writer writes everything held again, with backoff from :data:`RETRY_FIRST_S`
  to :data:`RETRY_MAX_S`, until the journal answers; the loop keeps serving
  ``/v1/status``, which shows the journal's health (:meth:`Outbox.health`);
- the service's ticker decides no deadline meanwhile (no eviction can be journaled);
  heartbeats still land in memory, so nobody is evicted for the outage itself.

:class:`~phalanx.controller.journal.base.Deposed` (another controller leads the job)
is final: nothing is written or acknowledged again, and ``on_deposed`` is called
once so the server can exit.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from phalanx.controller.core.base import Change, StateError, Tick
from phalanx.controller.journal.base import Deposed, Journal, JournalUnavailable
from phalanx.controller.statedir import CannotStart
from phalanx.protocol.status import JournalHealth

log = logging.getLogger("phalanx.controller")

RETRY_FIRST_S = 0.05
RETRY_MAX_S = 1.0
"""Backoff of the writes retried while the journal is unavailable."""
STOP_WAIT_S = 5.0
"""How long a stopping controller lets its last batch land."""


class NotAcknowledged(StateError):
    """A request answered 503: its changes, or earlier ones, are not journaled (the
    journal is unavailable), or this controller was deposed. The client retries it."""

    status = 503


class Outbox:
    def __init__(
        self,
        journal: Journal,
        wall: Callable[[], float],
        act: Callable[[list[Tick], bool], None],
        on_written: Callable[[], None],
    ):
        self.journal = journal
        self.wall = wall
        self.act = act
        """Called with the ticks made durable, in order, and whether a batch was written."""
        self.on_written = on_written
        """Called after each batch the journal committed (a metric)."""
        self.on_deposed: Callable[[], None] | None = None
        self.changes: list[Change] = []
        """Held: made by the core, not journaled yet."""
        self.ticks: list[tuple[int, Tick]] = []
        """Held ticks, each with the count of changes that must be durable first."""
        self.made = 0
        """Changes handed in so far."""
        self.durable = 0
        """Changes journaled so far (the held ones are ``made - durable``)."""
        self.error = ""
        """The journal's last failure (kept after it recovers, for the status)."""
        self.down_since: float | None = None
        self.deposed = ""
        self._writer: asyncio.Task[None] | None = None
        self._inflight: asyncio.Future[None] | None = None
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []

    @property
    def down(self) -> bool:
        """The journal is unavailable (the writer is retrying) or this controller is deposed."""
        return self.down_since is not None or bool(self.deposed)

    def commit(self, changes: list[Change], tick: Tick | None) -> None:
        """Hand in one core call's changes and tick. Writes them at once (or, with
        group commit, has the writer write them soon); acts on the ticks that are
        durable. Raises :class:`NotAcknowledged` while the journal is unavailable."""
        self.changes += changes
        self.made += len(changes)
        if tick is not None:
            self.ticks.append((self.made, tick))
        if self.down:
            self.check()  # raises: held, the writer retries them
        wrote = False
        if self.changes:
            if self.journal.group_commit and _loop() is not None:
                if self._writer is None:
                    self._writer = asyncio.get_running_loop().create_task(self._write_held())
            else:
                wrote = self._write_now()
        self._settle(wrote)
        if self.changes and not self.journal.group_commit:
            self.check()

    async def acknowledged(self) -> None:
        """Return once every change made so far is journaled; raise
        :class:`NotAcknowledged` if the journal cannot take them (or this controller
        was deposed). Every route awaits it before it replies."""
        target = self.made
        if self.durable >= target and not self.deposed and not self.journal.deposed:
            return
        self.check()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((target, fut))
        await fut

    def poll(self) -> None:
        """Take note of a deposition the journal found by itself (the etcd lease's
        keep-alive), before any write: called every tick and by :meth:`check`."""
        if not self.deposed and self.journal.deposed:
            self._deposed(self.journal.deposed)

    def check(self) -> None:
        """Raise :class:`NotAcknowledged` when deposed, or while the journal is down
        with changes held."""
        self.poll()
        if self.deposed:
            raise NotAcknowledged(f"{self.deposed}; this controller is stopping")
        if self.down_since is not None and self.changes:
            raise NotAcknowledged(
                f"journal {self.journal.where} is unavailable ({self.error}): the request "
                f"was not acknowledged; retry it (the controller resumes when the journal "
                f"answers)"
            )

    def _write_now(self) -> bool:
        try:
            self.journal.write(self.changes)
        except JournalUnavailable as e:
            self._unavailable(str(e))
            return False
        except Deposed as e:
            self._deposed(str(e))
            return False
        self._written(len(self.changes))
        return True

    def _written(self, n: int) -> None:
        del self.changes[:n]
        self.durable += n
        self.on_written()
        keep = []
        for target, fut in self._waiters:
            if target > self.durable:
                keep.append((target, fut))
            elif not fut.done():
                fut.set_result(None)
        self._waiters = keep

    def _settle(self, wrote: bool) -> None:
        """Act on the held ticks whose changes are durable, in order."""
        n = 0
        while n < len(self.ticks) and self.ticks[n][0] <= self.durable:
            n += 1
        ticks = [t for _, t in self.ticks[:n]]
        del self.ticks[:n]
        if ticks or wrote or not self.changes:
            self.act(ticks, wrote)

    def _fail_waiters(self) -> None:
        try:
            self.check()
        except NotAcknowledged as e:
            for _, fut in self._waiters:
                if not fut.done():
                    fut.set_exception(NotAcknowledged(str(e)))
            self._waiters = []

    def _unavailable(self, error: str) -> None:
        self.error = error
        if _loop() is None:  # at start: the controller does not start on it
            raise CannotStart(
                f"journal {self.journal.where} must take the controller's writes: {error}."
            )
        if self.down_since is None:
            self.down_since = self.wall()
            log.warning(
                "journal %s is unavailable (%s): not acknowledging until it answers",
                self.journal.where,
                error,
            )
        self._fail_waiters()
        if self._writer is None:
            self._writer = asyncio.get_running_loop().create_task(self._write_held())

    async def _write_held(self) -> None:
        """Write everything held, batch after batch, until nothing is held; while the
        journal is unavailable, with backoff."""
        loop = asyncio.get_running_loop()
        delay = RETRY_FIRST_S
        try:
            while self.changes and not self.deposed:
                if self.down_since is not None:
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, RETRY_MAX_S)
                batch = list(self.changes)
                self._inflight = loop.run_in_executor(None, self.journal.write, batch)
                try:
                    await self._inflight
                except JournalUnavailable as e:
                    self._unavailable(str(e))
                    continue
                except Deposed as e:
                    self._deposed(str(e))
                    return
                self._written(len(batch))
                if self.down_since is not None:
                    log.warning(
                        "journal %s answers again after %.1f s: acknowledging again",
                        self.journal.where,
                        self.wall() - self.down_since,
                    )
                    self.down_since = None
                    delay = RETRY_FIRST_S
                self._settle(True)
        finally:
            self._writer = None

    def _deposed(self, reason: str) -> None:
        first = not self.deposed
        self.deposed = reason
        self._fail_waiters()
        if first:
            log.error("%s: this controller stops acknowledging and exits", reason)
            if self.on_deposed is not None:
                self.on_deposed()

    def health(self) -> JournalHealth:
        return JournalHealth(
            kind=self.journal.kind,
            where=self.journal.where,
            healthy=not self.down,
            error=(self.deposed or self.error)[:1000],
            unavailable_since=self.down_since,
            unjournaled=len(self.changes),
            term=self.journal.term,
        )

    async def stop(self) -> None:
        """Let the batch being written land (a little while), then stop writing: held
        changes that were never acknowledged may be lost; no acknowledged one is."""
        writer = self._writer
        if writer is not None:
            if not self.down:
                await asyncio.wait([writer], timeout=STOP_WAIT_S)
            writer.cancel()
            try:
                await writer
            except asyncio.CancelledError:
                pass
        if self._inflight is not None and not self._inflight.done():
            # The thread cannot be cancelled: let it finish before the journal closes.
            await asyncio.wait([self._inflight], timeout=STOP_WAIT_S)


def _loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None

"""What stands between the core's changes and an acknowledgement: the journal write,
and what the service does while the journal cannot take one.

:meth:`Outbox.commit` is called by the service after every core call, on its event
loop, with the call's changes and its :class:`~phalanx.controller.core.base.Tick`.
Normally it writes the changes at once (one batch) and hands the tick back to be
acted on (wake the long-polls, drop the payloads), exactly as before there was an
outbox.

When the journal raises :class:`~phalanx.controller.journal.base.JournalUnavailable`
(an etcd that lost its quorum, or does not answer):

- the changes and ticks stay here, in order; the core has made them in memory, but
  no reply may tell anyone: every request that reaches :meth:`Outbox.acknowledge`
  (every route does, before it replies) gets a 503 with one line that says why, and
  the client retries it as it would a dropped connection. Nothing acknowledged is
  lost, and nothing unacknowledged is reported as done;
- a task writes everything held again, from a worker thread (the loop keeps
  serving ``/v1/status``, which shows the journal's health), with backoff from
  :data:`RETRY_FIRST_S` to :data:`RETRY_MAX_S`, until the journal answers. Then
  the held ticks are acted on, in order, and acknowledgements resume;
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


class NotAcknowledged(StateError):
    """A request answered 503: its changes, or earlier ones, are not journaled yet
    (or this controller was deposed). The client retries it."""

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
        """Called with the ticks made durable, in order, and whether anything was written."""
        self.on_written = on_written
        """Called after each batch the journal committed (a metric)."""
        self.on_deposed: Callable[[], None] | None = None
        self.changes: list[Change] = []
        self.ticks: list[Tick] = []
        self.error = ""
        """The journal's last failure (kept after it recovers, for the status)."""
        self.down_since: float | None = None
        self.deposed = ""
        self._retry: asyncio.Task[None] | None = None

    @property
    def down(self) -> bool:
        """The journal is unavailable (a retry is under way) or this controller is deposed."""
        return self._retry is not None or bool(self.deposed)

    def commit(self, changes: list[Change], tick: Tick | None) -> None:
        """Journal ``changes`` (one batch, with any still held), then act on the ticks
        made durable. Raises :class:`NotAcknowledged` when they are not durable."""
        self.changes += changes
        if tick is not None:
            self.ticks.append(tick)
        wrote = False
        if self.changes and not self.down:
            try:
                self.journal.write(self.changes)
            except JournalUnavailable as e:
                self._unavailable(str(e))
            except Deposed as e:
                self._deposed(str(e))
            else:
                wrote = True
                self.changes = []
                self.on_written()
        if not self.changes and not self.deposed:
            ticks, self.ticks = self.ticks, []
            self.act(ticks, wrote)
        self.acknowledge()

    def acknowledge(self) -> None:
        """Raise :class:`NotAcknowledged` while a change is not journaled: nothing the
        core holds in memory only may reach a reply."""
        if self.deposed:
            raise NotAcknowledged(f"{self.deposed}; this controller is stopping")
        if self.changes:
            raise NotAcknowledged(
                f"journal {self.journal.where} is unavailable ({self.error}): the request "
                f"was not acknowledged; retry it (the controller resumes when the journal "
                f"answers)"
            )

    def _unavailable(self, error: str) -> None:
        self.error = error
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # at start: the controller does not start on it
            raise CannotStart(
                f"journal {self.journal.where} must take the controller's writes: {error}."
            ) from None
        if self.down_since is None:
            self.down_since = self.wall()
            log.warning(
                "journal %s is unavailable (%s): not acknowledging until it answers",
                self.journal.where,
                error,
            )
        self._retry = loop.create_task(self._write_held())

    async def _write_held(self) -> None:
        loop = asyncio.get_running_loop()
        delay = RETRY_FIRST_S
        wrote = False
        try:
            while self.changes and not self.deposed:
                await asyncio.sleep(delay)
                batch = list(self.changes)
                try:
                    await loop.run_in_executor(None, self.journal.write, batch)
                except JournalUnavailable as e:
                    self.error = str(e)
                    delay = min(2 * delay, RETRY_MAX_S)
                    continue
                except Deposed as e:
                    self._deposed(str(e))
                    return
                del self.changes[: len(batch)]
                wrote = True
                self.on_written()
        finally:
            self._retry = None
        since = self.down_since or self.wall()
        self.down_since = None
        log.warning(
            "journal %s answers again after %.1f s: acknowledging again",
            self.journal.where,
            self.wall() - since,
        )
        ticks, self.ticks = self.ticks, []
        self.act(ticks, wrote)

    def _deposed(self, reason: str) -> None:
        first = not self.deposed
        self.deposed = reason
        if first:
            log.error("%s: this controller stops acknowledging and exits", reason)
            if self.on_deposed is not None:
                self.on_deposed()

    def health(self) -> JournalHealth:
        return JournalHealth(
            kind=self.journal.kind,
            where=self.journal.where,
            healthy=not self.down and not self.changes,
            error=(self.deposed or self.error)[:1000],
            unavailable_since=self.down_since,
            unjournaled=len(self.changes),
            term=self.journal.term,
        )

    async def stop(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
            try:
                await self._retry
            except asyncio.CancelledError:
                pass

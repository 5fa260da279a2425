"""One controller of a job on an etcd journal: the leader, or a standby that takes
over when the leader goes.

Started by :func:`phalanx.controller.server.serve` once its socket is bound. It
tries once to take office (``leader.py``); if a leader is alive it becomes a
standby:

- it registers under ``P/standby/<url>`` on a lease of its own (the leader's status
  lists it) and follows the journal (:class:`~.follower.Follower`);
- it answers every request with 421 and the leader's URL (:class:`~.switch.Switch`);
- every :data:`PROBE_EVERY_S` it connects to the leader's port. A refused connection
  means the leader's process is gone while its host is up: the standby revokes the
  leader's lease (the key goes at once, no TTL to wait) and campaigns. The leader key
  deleted (watched), or every :data:`CHECK_EVERY_S` in any case, it campaigns too:
  a leader on a lost host, partitioned, or stopped (a SIGSTOPped process still
  accepts connections) is replaced once its lease lapses;
- the winner stops following once its watch has reached the revision at which it
  took office, builds its service from those tables (no read of the prefix), and
  serves the leader's routes on the same socket. ``ControllerState.restore`` gives
  every member a fresh heartbeat grace, so nobody is evicted for the failover;
  leases, the ledger and commands are journaled and carry over.

Failure: a build that fails (CannotStart) stops the server with that line; a leader
deposed later stops it too (:class:`Deposed`, one line, exit 1).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from phalanx.controller.journal.base import JournalUnavailable, Tables
from phalanx.controller.journal.etcd_kv import EtcdKV, put
from phalanx.controller.journal.leader import LEASE_TTL_S, Leadership
from phalanx.controller.standby.follower import Follower
from phalanx.controller.standby.switch import App, Switch

log = logging.getLogger("phalanx.controller")

PROBE_EVERY_S = 0.05
"""How often a standby connects to the leader's port."""
CHECK_EVERY_S = 0.5
"""How often a standby campaigns whatever its watch says (one etcd transaction)."""
HANDOVER_WAIT_S = 2.0
"""How long a new leader waits for its watch to reach its own revision before it
reads the prefix instead."""

Build = Callable[[Leadership, "Tables | None"], tuple[Any, App]]
"""Builds the leader's service and app from the office taken and the tables followed
(None: read them from etcd). Runs on a worker thread."""


class Member:
    """The standby side of one controller (see the module docstring). The server
    calls :meth:`first_try` before serving, then serves :attr:`switch`."""

    def __init__(
        self,
        kv: EtcdKV,
        leader: Leadership,
        build: Build,
        announce: Callable[[str], None],
        failed: Callable[[BaseException], None],
    ):
        self.kv, self.leader, self.build, self.announce = kv, leader, build, announce
        self.failed = failed
        """Called with why a takeover failed: the server stops and raises it."""
        self.url = leader.url
        self.switch = Switch(self.url, leader.job_id, self._startup, self._shutdown)
        self.follower = Follower(kv, leader.prefix, self._on_leader)
        self.service: Any = None
        self.prebuilt: App | None = None
        """The leader's app, built before serving when this controller led at once."""
        self._gone: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._standby_lease = 0

    def first_try(self) -> dict[str, Any] | None:
        """Take office if nobody leads (returns None), else start following and
        return the leader key's value. Raises CannotStart (another job's prefix) or
        JournalUnavailable."""
        while True:
            leader = self.leader.campaign()
            if leader != {}:
                break
        if leader is None:
            self.service, self.prebuilt = self.build(self.leader, None)
            return None
        self.switch.leader_url = str(leader.get("url", ""))
        self.follower.start()
        self._register()
        return leader

    def _register(self) -> None:
        self._standby_lease = self.kv.grant(LEASE_TTL_S)
        value = json.dumps({"url": self.url, "since": time.time()}).encode()
        self.kv.txn([], [put(self._key(), value, self._standby_lease)], [])

    def _key(self) -> str:
        return f"{self.leader.prefix}/standby/{self.url}"

    def _on_leader(self, value: dict[str, Any] | None) -> None:
        """Called by the follower's thread: the leader key changed."""
        self.switch.leader_url = str(value.get("url", "")) if value else ""
        loop, gone = self._loop, self._gone
        if value is None and loop is not None and gone is not None:
            loop.call_soon_threadsafe(gone.set)

    async def _startup(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._gone = asyncio.Event()
        if self.prebuilt is not None:
            await self.switch.lead(self.prebuilt, self.leader.fenced)
        else:
            self._task = self._loop.create_task(self._stand_by())

    async def _shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self.follower.close()
        if self._standby_lease:
            await asyncio.to_thread(self._revoke, self._standby_lease)

    def _revoke(self, lease: int) -> None:
        try:
            self.kv.revoke(lease)
        except JournalUnavailable:
            pass  # it lapses by itself

    async def _stand_by(self) -> None:
        try:
            while True:
                await self._vacancy()
                try:
                    leader = await asyncio.to_thread(self.leader.campaign)
                    if leader is None:
                        break
                    if leader:
                        self.switch.leader_url = str(leader.get("url", ""))
                    ttl = await asyncio.to_thread(self.kv.keep_alive, self._standby_lease)
                    if ttl <= 0:
                        await asyncio.to_thread(self._register)
                except JournalUnavailable as e:
                    log.warning("standby of job %s: etcd: %s", self.leader.job_id, e)
            await self._take_over(self.leader.term_rev)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # stop the server, raise it there
            self.failed(e)

    async def _vacancy(self) -> None:
        """Return when an election may be due: the leader key went (watched), the
        leader's port refused a connection (its lease then revoked), or
        :data:`CHECK_EVERY_S` passed."""
        gone = self._gone or asyncio.Event()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CHECK_EVERY_S
        while not gone.is_set() and loop.time() < deadline:
            url = self.switch.leader_url
            # Its own URL: this process holds that socket, so the leader that had it
            # (this controller's predecessor, restarted on the same port) is gone.
            if url and (url == self.url or await _refused(url)):
                await asyncio.to_thread(self._depose, url)
                return
            try:
                await asyncio.wait_for(gone.wait(), PROBE_EVERY_S)
            except TimeoutError:
                pass
        gone.clear()

    def _depose(self, url: str) -> None:
        """Revoke the lease of the leader at ``url`` (its process is gone)."""
        try:
            kv = self.kv.get(self.leader.leader_key)
            held = json.loads(kv["value"]).get("url") if kv is not None else None
            if kv is not None and held == url and kv["lease"]:
                log.warning(
                    "standby: the leader at %s refused a connection: revoking its lease", url
                )
                self.kv.revoke(kv["lease"])
        except (JournalUnavailable, ValueError, AttributeError):
            pass  # another standby revoked it first, or etcd is down: campaign decides

    async def _take_over(self, revision: int) -> None:
        tables = await asyncio.to_thread(self.follower.handover, revision, HANDOVER_WAIT_S)
        if tables is None:
            log.warning(
                "standby: the watch lagged past %.1f s: reading the journal", HANDOVER_WAIT_S
            )
        if self._standby_lease:
            lease, self._standby_lease = self._standby_lease, 0
            await asyncio.to_thread(self._revoke, lease)
        self.service, app = await asyncio.to_thread(self.build, self.leader, tables)
        await self.switch.lead(app, self.leader.fenced)
        self.announce(
            f"phalanx controller for job {self.leader.job_id} (epoch {self.service.epoch}, "
            f"leader term {self.leader.term}) at {self.url}"
        )


async def _refused(url: str) -> bool:
    """Whether a TCP connection to ``url``'s host and port is refused (a dead process
    on a live host). A timeout or any other failure: False (the lease decides)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(parts.hostname, port), 0.25)
    except ConnectionRefusedError:
        return True
    except (OSError, TimeoutError):
        return False
    writer.close()
    return False

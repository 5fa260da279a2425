"""The controller's own rollout queues: the ``controller`` backend of the
:class:`~phalanx.transport.base.RolloutQueue` contract.

Part of the controller's pure core (no I/O, no clock: every call takes
``now``/``wall``), journaled through the same change log as the rest of it,
so a controller killed and restarted on its state dir keeps every queued,
leased and settled rollout. The rollouts themselves are not journaled: they
go to the controller's payload log (:mod:`~phalanx.controller.payloads`) as
the :class:`~phalanx.controller.core.base.Tick`'s ``puts``, and the core reads
them back through the ``payload_of`` lookup it is given. The HTTP side is
:mod:`~phalanx.controller.http.queue`; the client is
:class:`~phalanx.transport.controller_queue.ControllerRolloutQueue`.

A controller holds any number of named queues (up to :data:`MAX_QUEUES`),
created by their first put or lease. Each is a consumer group of its own:
a rollout is delivered to one consumer at a time. Tables:

- ``rq_items``: ``<queue>/<rollout id>`` -> its put ``seq`` and the crc32 of
  its JSON (the rollout is in the payload log under ``q/<queue>/<rollout
  id>``). Written once at put, deleted at ack or discard;
- ``rq_leases``: ``<queue>/<rollout id>`` -> the newest delivery (attempt,
  consumer, lease_s, whether still held). A restored lease gets a fresh
  deadline, like the ledger's prompt leases: its holder may still ack it;
- ``rq_done``: ``<queue>/<rollout id>`` -> acked or discarded (and why): the
  deduplication index, kept for the life of the queue (a few bytes per
  rollout), as Redis's id hash and the spool's ack markers are;
- ``rq_meta``: ``<queue>`` -> counters; ``rq_quarantine``: corrupt records.

When the controller starts, every queued rollout is checked against its crc
(and found in the payload log at all): a damaged or missing one (a bad disk,
a hand edit, a torn write) is moved to ``rq_quarantine`` and counted as
``corrupt``, and the controller starts as usual.

Not the RL ledger (:mod:`~phalanx.controller.core.ledger`): a queued rollout is
any JSON object with a ``rollout_id``, and nothing here knows prompts or
steps. An RL job's rollout replicas submit to the ledger directly
(``transport/factory.py`` says why); these queues serve everything else
that wants the contract with nothing to install.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from phalanx.controller.core.base import ChangeLog, StateError, Tick
from phalanx.controller.core.codec import encode
from phalanx.protocol.queue import MAX_QUEUES

PayloadOf = Callable[[str], Any]
"""The payload log's lookup: the rollout stored under a key, or None."""


def checksum(rollout: dict[str, Any]) -> int:
    """crc32 of the rollout's compact JSON."""
    return zlib.crc32(encode(rollout).encode())


def _legacy_checksum(rollout: dict[str, Any]) -> int:
    """The crc of journals written before :func:`~phalanx.controller.core.codec.encode`
    (the standard library's encoder, which spells some floats differently: 1e-05)."""
    return zlib.crc32(json.dumps(rollout, separators=(",", ":")).encode())


def payload_key(queue: str, rollout_id: str) -> str:
    """A queued rollout's key in the controller's payload log."""
    return f"q/{queue}/{rollout_id}"


@dataclass
class Item:
    rollout_id: str
    seq: int
    crc: int
    attempt: int = 0
    """Deliveries so far (the next one is ``attempt + 1``)."""
    consumer: str = ""
    lease_s: float = 0.0
    deadline: float | None = None
    """Monotonic end of the current lease; None when not held."""

    def record(self, queue: str) -> dict[str, Any]:
        return {"q": queue, "id": self.rollout_id, "seq": self.seq, "crc": self.crc}

    def lease_record(self, queue: str) -> dict[str, Any]:
        return {
            "q": queue,
            "id": self.rollout_id,
            "attempt": self.attempt,
            "consumer": self.consumer,
            "lease_s": self.lease_s,
            "held": self.deadline is not None,
        }


@dataclass
class Delivered:
    rollout_id: str
    rollout: dict[str, Any]
    attempt: int
    deadline: float
    """Wall-clock end of the lease."""


class QueueBook:
    """One named queue: queued and leased rollouts, the settled ids, the counters."""

    def __init__(self, name: str, log: ChangeLog, payload_of: PayloadOf):
        self.name, self.log, self.payload_of = name, log, payload_of
        self.items: dict[str, Item] = {}
        """Queued and leased rollouts, in put order."""
        self.ready: dict[str, None] = {}
        """Ids not held by a consumer (an ordered set: put order, nacked ones last)."""
        self.held: dict[str, Item] = {}
        self.settled: dict[str, str] = {}
        """rollout id -> ``a`` (acked) or ``d:<reason>`` (discarded)."""
        self.counts = {"put": 0, "acked": 0, "duplicates": 0, "corrupt": 0}
        self.discarded: dict[str, int] = {}
        self.seq = 0

    def _key(self, rid: str) -> str:
        return f"{self.name}/{rid}"

    def _save_meta(self) -> None:
        self.log.put(
            "rq_meta",
            self.name,
            {"seq": self.seq, "counts": self.counts, "discarded": self.discarded},
        )

    # -- restore ---------------------------------------------------------

    def restore(
        self,
        meta: dict[str, Any],
        items: list[tuple[str, dict[str, Any]]],
        leases: dict[str, dict[str, Any]],
        done: dict[str, dict[str, Any]],
        now: float,
        moved: list[tuple[str, Any]],
    ) -> None:
        """Rebuild from the journal. A record that still holds its rollout (a journal
        written before the payload log) has it moved out: appended to ``moved`` for
        the payload log, and its record rewritten without it."""
        self.seq = meta.get("seq", 0)
        self.counts.update(meta.get("counts", {}))
        self.discarded = dict(meta.get("discarded", {}))
        for rid, rec in done.items():
            self.settled[rid] = "a" if rec.get("s") == "a" else f"d:{rec.get('reason', '')}"
        good: list[Item] = []
        for key, rec in items:
            try:
                rid = rec["id"]
                rollout = (
                    rec["rollout"]
                    if "rollout" in rec
                    else self.payload_of(payload_key(self.name, rid))
                )
                if (
                    not isinstance(rollout, dict)
                    or rollout.get("rollout_id") != rid
                    or rec["crc"] not in (checksum(rollout), _legacy_checksum(rollout))
                ):
                    raise ValueError
                it = Item(rid, int(rec["seq"]), int(rec["crc"]))
                if "rollout" in rec:
                    moved.append((payload_key(self.name, rid), rollout))
                    self.log.put("rq_items", key, it.record(self.name))
                good.append(it)
            except (KeyError, TypeError, ValueError):
                # Damaged or lost: keep the journal's bytes aside, count it, go on.
                self.log.put("rq_items", key, None)
                self.log.put("rq_leases", key, None)
                self.log.put("rq_quarantine", key, {"q": self.name, "record": rec})
                self.counts["corrupt"] += 1
        for it in sorted(good, key=lambda i: i.seq):
            lease = leases.get(it.rollout_id, {})
            it.attempt, it.consumer = int(lease.get("attempt", 0)), str(lease.get("consumer", ""))
            it.lease_s = float(lease.get("lease_s", 0.0))
            self.items[it.rollout_id] = it
            if lease.get("held"):
                it.deadline = now + it.lease_s
                self.held[it.rollout_id] = it
            else:
                self.ready[it.rollout_id] = None
        self._save_meta()

    # -- requests --------------------------------------------------------

    def put(self, rollouts: Sequence[dict[str, Any]], tick: Tick) -> tuple[list[str], int]:
        """Queue ``rollouts`` (validated by the caller); their payloads go into
        ``tick.puts``. Returns (the ids queued, how many were dropped as duplicates:
        queued, leased or settled before)."""
        added: list[str] = []
        dups = 0
        for r in rollouts:
            rid = r["rollout_id"]
            if rid in self.items or rid in self.settled:
                dups += 1
                continue
            self.seq += 1
            it = Item(rid, self.seq, checksum(r))
            self.items[rid] = it
            self.ready[rid] = None
            self.log.put("rq_items", self._key(rid), it.record(self.name))
            tick.puts.append((payload_key(self.name, rid), r))
            added.append(rid)
        self.counts["put"] += len(added)
        self.counts["duplicates"] += dups
        self._save_meta()
        return added, dups

    def lease(
        self, consumer: str, n: int, lease_s: float, now: float, wall: float
    ) -> list[Delivered]:
        """Up to ``n`` rollouts for ``consumer``, each held ``lease_s``: expired leases
        first (oldest deadline first), then queued ones in put order."""
        expired = sorted(
            (it for it in self.held.values() if it.deadline is not None and it.deadline <= now),
            key=lambda it: (it.deadline, it.seq),
        )
        picked = expired[:n]
        if len(picked) < n:
            for rid in self.ready:
                picked.append(self.items[rid])
                if len(picked) == n:
                    break
        out = []
        for it in picked:
            self.ready.pop(it.rollout_id, None)
            it.attempt += 1
            it.consumer, it.lease_s = consumer, lease_s
            it.deadline = now + lease_s
            self.held[it.rollout_id] = it
            self.log.put("rq_leases", self._key(it.rollout_id), it.lease_record(self.name))
            rollout = self.payload_of(payload_key(self.name, it.rollout_id))
            out.append(Delivered(it.rollout_id, rollout, it.attempt, wall + lease_s))
        return out

    def next_expiry(self) -> float | None:
        """Monotonic time the earliest lease ends (a lease long-poll wakes then)."""
        return min((it.deadline for it in self.held.values() if it.deadline), default=None)

    def settle(self, ids: Sequence[str], reason: str | None, tick: Tick) -> int:
        """Ack (``reason`` None) or discard these ids, whoever holds them now: the
        consumer that settles first wins. Returns how many were not settled before."""
        n = 0
        for rid in dict.fromkeys(ids):
            if rid not in self.items:
                continue  # settled before, quarantined, or never put: nothing to do
            del self.items[rid]
            self.ready.pop(rid, None)
            self.held.pop(rid, None)
            self.log.put("rq_items", self._key(rid), None)
            self.log.put("rq_leases", self._key(rid), None)
            tick.drops.append(payload_key(self.name, rid))
            if reason is None:
                self.settled[rid] = "a"
                self.counts["acked"] += 1
                self.log.put("rq_done", self._key(rid), {"q": self.name, "id": rid, "s": "a"})
            else:
                self.settled[rid] = f"d:{reason}"
                self.discarded[reason] = self.discarded.get(reason, 0) + 1
                rec = {"q": self.name, "id": rid, "s": "d", "reason": reason}
                self.log.put("rq_done", self._key(rid), rec)
            n += 1
        if n:
            self._save_meta()
        return n

    def nack(self, deliveries: Sequence[tuple[str, int]]) -> int:
        """Give back (rollout id, attempt) deliveries still held under that attempt:
        a late nack of an expired, re-delivered lease leaves the new holder alone."""
        n = 0
        for rid, attempt in deliveries:
            it = self.held.get(rid)
            if it is None or it.attempt != attempt:
                continue
            del self.held[rid]
            it.deadline = None
            self.ready[rid] = None
            self.log.put("rq_leases", self._key(rid), it.lease_record(self.name))
            n += 1
        return n

    def status(self) -> dict[str, Any]:
        return {
            "pending": len(self.items),
            "leased": len(self.held),
            **self.counts,
            "discarded": dict(sorted(self.discarded.items())),
        }


class RolloutQueues:
    """Every named queue of a controller, and the requests on them. Each request
    returns ``(reply, Tick)`` like the rest of the core."""

    def __init__(self, log: ChangeLog, payload_of: PayloadOf):
        self.log, self.payload_of = log, payload_of
        self.books: dict[str, QueueBook] = {}

    def book(self, name: str, create: bool = True) -> QueueBook | None:
        b = self.books.get(name)
        if b is None and create:
            if len(self.books) >= MAX_QUEUES:
                raise StateError(
                    f"queue must be one of at most {MAX_QUEUES} named queues per controller: "
                    f"got a new name {name!r} with {len(self.books)} in use. Reuse a queue name.",
                    field="queue",
                )
            b = self.books[name] = QueueBook(name, self.log, self.payload_of)
        return b

    def restore(
        self, tables: dict[str, dict[str, dict[str, Any]]], now: float
    ) -> list[tuple[str, Any]]:
        """Rebuild every queue; returns the payloads moved out of old journal records
        (for the payload log)."""

        def by_queue(table: str) -> dict[str, list[tuple[str, dict[str, Any]]]]:
            out: dict[str, list[tuple[str, dict[str, Any]]]] = {}
            for key, rec in tables.get(table, {}).items():
                out.setdefault(key.split("/", 1)[0], []).append((key, rec))
            return out

        metas = tables.get("rq_meta", {})
        items, leases, done = by_queue("rq_items"), by_queue("rq_leases"), by_queue("rq_done")
        moved: list[tuple[str, Any]] = []
        for name in sorted(set(metas) | set(items) | set(leases) | set(done)):
            b = self.books[name] = QueueBook(name, self.log, self.payload_of)
            b.restore(
                metas.get(name, {}),
                items.get(name, []),
                {k.split("/", 1)[1]: r for k, r in leases.get(name, [])},
                {k.split("/", 1)[1]: r for k, r in done.get(name, [])},
                now,
                moved,
            )
        return moved

    def keys(self) -> set[str]:
        """Payload-log keys of every queued rollout (the log keeps these at a restart)."""
        return {payload_key(b.name, rid) for b in self.books.values() for rid in b.items}

    def put(
        self, name: str, rollouts: list[dict[str, Any]], *, now: float, wall: float
    ) -> tuple[tuple[list[str], int], Tick]:
        b = self.book(name)
        if b is None:  # unreachable: create=True makes it or raises
            raise StateError(f"queue {name!r} could not be made", field="queue")
        tick = Tick()
        added, dups = b.put(rollouts, tick)
        if added:
            tick.queues.add(name)
        return (added, dups), tick

    def lease(
        self, name: str, consumer: str, n: int, lease_s: float, *, now: float, wall: float
    ) -> tuple[list[Delivered], Tick]:
        b = self.book(name, create=False)  # a lease creates nothing: a put will
        return (b.lease(consumer, n, lease_s, now, wall) if b is not None else []), Tick()

    def settle(
        self,
        name: str,
        deliveries: list[tuple[str, int]],
        how: str,
        reason: str = "",
        *,
        now: float,
        wall: float,
    ) -> tuple[int, Tick]:
        """``how``: ``ack``, ``discard`` (with ``reason``) or ``nack``."""
        b = self.book(name, create=False)
        tick = Tick()
        if b is None:
            return 0, tick
        if how == "nack":
            n = b.nack(deliveries)
            if n:
                tick.queues.add(name)
            return n, tick
        n = b.settle([rid for rid, _ in deliveries], reason if how == "discard" else None, tick)
        return n, tick

    def status(self, name: str | None = None) -> dict[str, Any]:
        if name is not None:
            b = self.books.get(name)
            empty = QueueBook(name, self.log, self.payload_of)
            return empty.status() if b is None else b.status()
        return {n: b.status() for n, b in sorted(self.books.items())}

"""The controller's own rollout queues: the ``controller`` backend of the
:class:`~phalanx.transport.base.RolloutQueue` contract.

Part of the controller's pure state machine (no I/O, no clock: every call
takes ``now``/``wall``), journaled through the same ``(table, key, record)``
changes as the rest of it, so a controller killed and restarted on its
state dir keeps every queued, leased and settled rollout. The HTTP side is
:mod:`~phalanx.controller.queue_api`; the client is
:class:`~phalanx.transport.controller_queue.ControllerRolloutQueue`.

A controller holds any number of named queues (up to :data:`MAX_QUEUES`),
created by their first put or lease. Each is a consumer group of its own:
a rollout is delivered to one consumer at a time. Tables:

- ``rq_items``: ``<queue>/<rollout id>`` -> the rollout, its put ``seq`` and
  the crc32 of its JSON. Written once at put, deleted at ack or discard;
- ``rq_leases``: ``<queue>/<rollout id>`` -> the newest delivery (attempt,
  consumer, lease_s, whether still held). A restored lease gets a fresh
  deadline, like the ledger's prompt leases: its holder may still ack it;
- ``rq_done``: ``<queue>/<rollout id>`` -> acked or discarded (and why): the
  deduplication index, kept for the life of the queue (a few bytes per
  rollout), as Redis's id hash and the spool's ack markers are;
- ``rq_meta``: ``<queue>`` -> counters; ``rq_quarantine``: corrupt records.

A record is checked against its crc when the journal is read back: a
damaged one (a bad disk, a hand edit) is moved to ``rq_quarantine`` and
counted as ``corrupt``, and the controller starts as usual.

Not the RL ledger (:mod:`~phalanx.controller.ledger`): a queued rollout is
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

from phalanx.controller.journal import encode
from phalanx.controller.tick import StateError, Tick

Put = Callable[[str, str, dict[str, Any] | None], None]

MAX_QUEUES = 64
"""Named queues one controller holds; a 65th name is refused (a typo, or a leak)."""
MAX_BATCH = 4096
"""Rollouts (or deliveries) one request may carry."""
MAX_WAIT_S = 30.0
"""Longest lease long-poll (the controller's ``MAX_WAIT_S``)."""


def checksum(rollout: dict[str, Any]) -> int:
    """crc32 of the rollout's compact JSON (what the journal stores, re-encoded)."""
    return zlib.crc32(encode(rollout).encode())


def _legacy_checksum(rollout: dict[str, Any]) -> int:
    """The crc of journals written before :func:`~phalanx.controller.journal.encode`
    (the standard library's encoder, which spells some floats differently: 1e-05)."""
    return zlib.crc32(json.dumps(rollout, separators=(",", ":")).encode())


@dataclass
class Item:
    rollout_id: str
    rollout: dict[str, Any]
    seq: int
    crc: int
    attempt: int = 0
    """Deliveries so far (the next one is ``attempt + 1``)."""
    consumer: str = ""
    lease_s: float = 0.0
    deadline: float | None = None
    """Monotonic end of the current lease; None when not held."""

    def record(self, queue: str) -> dict[str, Any]:
        return {
            "q": queue,
            "id": self.rollout_id,
            "seq": self.seq,
            "crc": self.crc,
            "rollout": self.rollout,
        }

    def lease_record(self, queue: str) -> dict[str, Any]:
        return {
            "q": queue,
            "id": self.rollout_id,
            "attempt": self.attempt,
            "consumer": self.consumer,
            "lease_s": self.lease_s,
            "held": self.deadline is not None,
        }


class QueueBook:
    """One named queue: queued and leased rollouts, the settled ids, the counters."""

    def __init__(self, name: str, put: Put):
        self.name, self._put = name, put
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
        self._put(
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
    ) -> None:
        self.seq = meta.get("seq", 0)
        self.counts.update(meta.get("counts", {}))
        self.discarded = dict(meta.get("discarded", {}))
        for rid, rec in done.items():
            self.settled[rid] = "a" if rec.get("s") == "a" else f"d:{rec.get('reason', '')}"
        good: list[Item] = []
        for key, rec in items:
            try:
                rid, rollout = rec["id"], rec["rollout"]
                if (
                    not isinstance(rollout, dict)
                    or rollout.get("rollout_id") != rid
                    or rec["crc"] not in (checksum(rollout), _legacy_checksum(rollout))
                ):
                    raise ValueError
                good.append(Item(rid, rollout, int(rec["seq"]), int(rec["crc"])))
            except (KeyError, TypeError, ValueError):
                # Damaged in the journal: keep the bytes aside, count it, go on.
                self._put("rq_items", key, None)
                self._put("rq_leases", key, None)
                self._put("rq_quarantine", key, {"q": self.name, "record": rec})
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

    def put(self, rollouts: Sequence[dict[str, Any]]) -> tuple[list[str], int]:
        """Queue ``rollouts`` (validated by the caller). Returns (the ids queued, how
        many were dropped as duplicates: queued, leased or settled before)."""
        added: list[str] = []
        dups = 0
        for r in rollouts:
            rid = r["rollout_id"]
            if rid in self.items or rid in self.settled:
                dups += 1
                continue
            self.seq += 1
            it = Item(rid, r, self.seq, checksum(r))
            self.items[rid] = it
            self.ready[rid] = None
            self._put("rq_items", self._key(rid), it.record(self.name))
            added.append(rid)
        self.counts["put"] += len(added)
        self.counts["duplicates"] += dups
        self._save_meta()
        return added, dups

    def lease(
        self, consumer: str, n: int, lease_s: float, now: float, wall: float
    ) -> list[dict[str, Any]]:
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
            self._put("rq_leases", self._key(it.rollout_id), it.lease_record(self.name))
            out.append(
                {
                    "rollout_id": it.rollout_id,
                    "rollout": it.rollout,
                    "attempt": it.attempt,
                    "deadline": wall + lease_s,
                }
            )
        return out

    def next_expiry(self) -> float | None:
        """Monotonic time the earliest lease ends (a lease long-poll wakes then)."""
        return min((it.deadline for it in self.held.values() if it.deadline), default=None)

    def settle(self, ids: Sequence[str], reason: str | None) -> int:
        """Ack (``reason`` None) or discard these ids, whoever holds them now: the
        consumer that settles first wins. Returns how many were not settled before."""
        n = 0
        for rid in dict.fromkeys(ids):
            if rid not in self.items:
                continue  # settled before, quarantined, or never put: nothing to do
            del self.items[rid]
            self.ready.pop(rid, None)
            self.held.pop(rid, None)
            self._put("rq_items", self._key(rid), None)
            self._put("rq_leases", self._key(rid), None)
            if reason is None:
                self.settled[rid] = "a"
                self.counts["acked"] += 1
                self._put("rq_done", self._key(rid), {"q": self.name, "id": rid, "s": "a"})
            else:
                self.settled[rid] = f"d:{reason}"
                self.discarded[reason] = self.discarded.get(reason, 0) + 1
                rec = {"q": self.name, "id": rid, "s": "d", "reason": reason}
                self._put("rq_done", self._key(rid), rec)
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
            self._put("rq_leases", self._key(rid), it.lease_record(self.name))
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
    returns ``(reply, Tick)`` like the rest of the state machine."""

    def __init__(self, put: Put):
        self._put = put
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
            b = self.books[name] = QueueBook(name, self._put)
        return b

    def restore(self, tables: dict[str, dict[str, dict[str, Any]]], now: float) -> None:
        def by_queue(table: str) -> dict[str, list[tuple[str, dict[str, Any]]]]:
            out: dict[str, list[tuple[str, dict[str, Any]]]] = {}
            for key, rec in tables.get(table, {}).items():
                out.setdefault(key.split("/", 1)[0], []).append((key, rec))
            return out

        metas = tables.get("rq_meta", {})
        items, leases, done = by_queue("rq_items"), by_queue("rq_leases"), by_queue("rq_done")
        for name in sorted(set(metas) | set(items) | set(leases) | set(done)):
            b = self.books[name] = QueueBook(name, self._put)
            b.restore(
                metas.get(name, {}),
                items.get(name, []),
                {k.split("/", 1)[1]: r for k, r in leases.get(name, [])},
                {k.split("/", 1)[1]: r for k, r in done.get(name, [])},
                now,
            )

    def put(
        self, name: str, rollouts: list[dict[str, Any]], *, now: float, wall: float
    ) -> tuple[dict[str, Any], Tick]:
        b = self.book(name)
        assert b is not None
        added, dups = b.put(rollouts)
        return {"queued": added, "duplicates": dups}, Tick(queues={name} if added else set())

    def lease(
        self, name: str, consumer: str, n: int, lease_s: float, *, now: float, wall: float
    ) -> tuple[dict[str, Any], Tick]:
        b = self.book(name, create=False)  # a lease creates nothing: a put will
        out = b.lease(consumer, n, lease_s, now, wall) if b is not None else []
        return {"deliveries": out}, Tick()

    def settle(
        self,
        name: str,
        deliveries: list[tuple[str, int]],
        how: str,
        reason: str = "",
        *,
        now: float,
        wall: float,
    ) -> tuple[dict[str, Any], Tick]:
        """``how``: ``ack``, ``discard`` (with ``reason``) or ``nack``."""
        b = self.book(name, create=False)
        if b is None:
            return {"settled": 0}, Tick()
        if how == "nack":
            n = b.nack(deliveries)
            return {"settled": n}, Tick(queues={name} if n else set())
        n = b.settle([rid for rid, _ in deliveries], reason if how == "discard" else None)
        return {"settled": n}, Tick()

    def status(self, name: str | None = None) -> dict[str, Any]:
        if name is not None:
            b = self.books.get(name)
            return QueueBook(name, self._put).status() if b is None else b.status()
        return {n: b.status() for n, b in sorted(self.books.items())}

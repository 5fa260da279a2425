"""What every part of the controller's core shares: the refusals it raises, the
change log it journals through, and the :class:`Tick` of waiters the service
must wake once a call's changes are durable."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from phalanx.controller.core.codec import drop_out_of_bounds

if TYPE_CHECKING:
    from phalanx.protocol.membership import Quorum

Change = tuple[str, str, dict[str, Any] | None]
"""``(table, key, record)``: one row the journal must write (``None`` deletes it)."""

PayloadOf = Callable[[str], Any]
"""The payload log's lookup: the payload stored under a key, or None."""

RETIRED_TABLES = ("rq_items", "rq_leases", "rq_done", "rq_meta", "rq_quarantine")
"""Tables an older controller journaled and nothing reads any more (the named rollout
queues it held, removed with the ``/v1/queue`` routes). A restore deletes their
records, and the payload log drops the rollouts they kept (no record refers to them)."""


class StateError(Exception):
    """A request the core refuses. ``status`` is the HTTP status to use."""

    status = 400

    def __init__(self, message: str, field: str | None = None, status: int | None = None):
        super().__init__(message)
        self.field = field
        if status is not None:
            self.status = status


class UnknownReplica(StateError):
    """The replica id is not a member: never registered, or evicted (gone for good)."""

    status = 410


class Conflict(StateError):
    status = 409


class ChangeLog:
    """The durable changes of the calls since the last :meth:`drain`, and the job's
    event log. Every part of the core writes through one shared instance; the
    service drains it into the journal before it answers."""

    def __init__(self, history: int):
        self.history = history
        """Events kept (older ones are deleted from the journal too)."""
        self.changes: list[Change] = []
        self.events: list[dict[str, Any]] = []
        self.event_seq = 0
        self.dropped: list[tuple[str, str, str]] = []

    def put(self, table: str, key: str, record: dict[str, Any] | None) -> None:
        self.changes.append((table, key, record))

    def drain(self) -> list[Change]:
        out, self.changes = self.changes, []
        return out

    def event(self, kind: str, wall: float, **fields: Any) -> None:
        self.event_seq += 1
        ev = {"seq": self.event_seq, "kind": kind, "at": wall, **fields}
        self.events.append(ev)
        self.put("events", f"{self.event_seq:012d}", ev)
        while len(self.events) > self.history:
            old = self.events.pop(0)
            self.put("events", f"{old['seq']:012d}", None)
        self.put("meta", "event_seq", {"value": self.event_seq})

    def restore(self, tables: dict[str, dict[str, dict[str, Any]]]) -> None:
        """Read the event log back, after dropping (from ``tables`` and the journal) any
        record with an out-of-bound integer: :attr:`dropped` lists them for the event log."""
        self.dropped = drop_out_of_bounds(tables)
        for tbl, key, _ in self.dropped:
            self.put(tbl, key, None)
        meta = tables.get("meta", {})
        self.event_seq = meta.get("event_seq", {}).get("value", 0)
        self.events = [tables["events"][k] for k in sorted(tables.get("events", {}))]


@dataclass
class Tick:
    """What a call changed that the service must act on once it is journaled."""

    formed: list[Quorum] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    probe: list[str] = field(default_factory=list)
    commands_for: set[str] = field(default_factory=set)
    ledger_for: set[str] = field(default_factory=set)
    """Replicas whose ledger long-poll (prompt or batch lease) may now have an answer."""
    puts: list[tuple[str, Any]] = field(default_factory=list)
    """(key, payload) to write to the controller's payload log *before* the commit:
    the payloads of rollouts the call accepted."""
    drops: list[str] = field(default_factory=list)
    """Keys of the payload log that nothing refers to any more (trained or
    discarded): dropped after the commit."""
    sweeps: list[tuple[str, str]] = field(default_factory=list)
    """(ref, reason) of payloads to drop from a rollout store outside the controller
    (journaled until the service's collector has made them)."""

    def merge(self, other: Tick) -> Tick:
        self.formed += other.formed
        self.evicted += other.evicted
        self.probe += other.probe
        self.commands_for |= other.commands_for
        self.ledger_for |= other.ledger_for
        self.puts += other.puts
        self.drops += other.drops
        self.sweeps += other.sweeps
        return self

"""The controller's journal: where every durable transition is written before the
controller acknowledges it.

The core reports each durable change as ``(table, key, record)`` (``None`` deletes the
row); :class:`~phalanx.controller.service.ControllerService` hands the changes of
one call (one tick of the controller) to :meth:`Journal.write` as one batch, and
answers the request only after it returns. A controller started again, on the same
journal, reads the tables back with :meth:`Journal.load`.

Two implementations, after their mechanism: ``sqlite.py`` (:class:`SqliteJournal`,
the embedded default: a file in the state dir) and ``etcd.py`` (:class:`EtcdJournal`:
an etcd cluster replicates it, and only the leader of the job may write it).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Any, Literal

from phalanx.controller.core.base import RETIRED_TABLES, Change
from phalanx.controller.statedir import CannotStart
from phalanx.protocol.status import Controllers

Tables = dict[str, dict[str, dict[str, Any]]]
"""``{table: {key: record}}``: the journal's rows."""

LENIENT_TABLES = RETIRED_TABLES
"""Tables whose records nothing reads (an older controller's, deleted by the restore): a
record there that is not even JSON is handed over as ``{"unreadable": text}`` instead of
failing the load."""


def decode(where: str, tbl: str, key: str, text: str, fix: str) -> dict[str, Any]:
    """The record of row ``tbl/key`` of the journal at ``where``, from its JSON text. Text
    that is not JSON raises CannotStart in one line naming the row and saying ``fix``
    (how to restore the journal), except in :data:`LENIENT_TABLES`."""
    try:
        rec: dict[str, Any] = json.loads(text)
    except ValueError as e:
        if tbl not in LENIENT_TABLES:
            raise CannotStart(
                f"journal {where} is damaged: record {tbl}/{key} is not JSON ({e}). {fix}"
            ) from None
        rec = {"unreadable": text}  # deleted by the restore with its table
    return rec


class JournalUnavailable(RuntimeError):
    """The journal could not commit a batch now: etcd has lost its quorum, does not
    answer, or refused the write (its message says why). The batch may or may not
    have landed: the caller keeps it and writes it again, with the changes made since
    (writing the same final values twice is harmless). Nothing may be acknowledged
    meanwhile."""


class Deposed(RuntimeError):
    """Another controller leads the job now (its leader key replaced this one's, whose
    lease lapsed): nothing of the batch landed, and every later write raises this too.
    The controller must stop acknowledging and exit."""


def last_wins(changes: list[Change]) -> dict[tuple[str, str], dict[str, Any] | None]:
    """The final record of each row a batch touches (later changes to a key win)."""
    last: dict[tuple[str, str], dict[str, Any] | None] = {}
    for tbl, key, rec in changes:
        last[(tbl, key)] = rec
    return last


class Journal(ABC):
    """Durable tables, written in atomic batches.

    Called by the controller service only, from one thread at a time: the service's
    event loop, or the thread it writes from while it retries after a
    :class:`JournalUnavailable`. A journal is opened before the service starts and
    closed when it stops."""

    kind: Literal["sqlite", "etcd"]
    """``sqlite`` or ``etcd``, as ``controller.journal`` names it (the status API's
    ``journal.kind``)."""
    where: str
    """What a message names: the file, or the etcd URL and key prefix."""
    writes: int
    """Batches committed by this process."""
    group_commit = False
    """Batch the writes of concurrent requests, written from a worker thread (a
    journal whose write is a network round trip); False: write each call's batch at
    once, on the service's loop (:mod:`phalanx.controller.outbox`)."""

    @property
    def deposed(self) -> str:
        """Why this controller may no longer write ('' while it may; SQLite: always)."""
        return ""

    @property
    def term(self) -> int | None:
        """The leader term this controller writes in (etcd), or None (SQLite)."""
        return None

    def controllers(self) -> Controllers | None:
        """The leader and standbys of the job (etcd), or None (SQLite: one controller)."""
        return None

    @abstractmethod
    def load(self) -> Tables:
        """Every row as last committed. Called once, before the first write. A record
        that cannot be read raises :class:`~phalanx.controller.statedir.CannotStart`
        with a line naming it."""

    @abstractmethod
    def write(self, changes: list[Change]) -> None:
        """Apply one batch atomically (all of it or none of it), later changes to a
        key winning; returns once it is durable. Raises :class:`JournalUnavailable`
        (try again later, with the same changes) or :class:`Deposed` (never again)."""

    @abstractmethod
    def close(self) -> None:
        """Release what the journal holds (the file; the etcd lease and leader key)."""

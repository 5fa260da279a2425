"""Durable controller state: a SQLite journal (WAL) in the job's state dir, the
embedded default (``controller.journal = "sqlite"``).

The state machine reports every durable change as ``(table, key, record)``;
:meth:`SqliteJournal.write` applies one batch of them in a single transaction,
and the server answers the request only after it returns. A controller
killed with SIGKILL and restarted on the same state dir reads the tables
back with :meth:`SqliteJournal.load`.

``synchronous=NORMAL`` (the default) survives the controller process
being killed at any instant: a committed WAL frame is in the OS page cache.
``synchronous=FULL`` also survives a power loss, at one fsync per write.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from phalanx.controller.core.base import RETIRED_TABLES, Change
from phalanx.controller.core.codec import encode
from phalanx.controller.journal.base import Journal, Tables, last_wins
from phalanx.controller.statedir import CannotStart

LENIENT_TABLES = RETIRED_TABLES
"""Tables whose records nothing reads (an older controller's, deleted by the restore): a
record there that is not even JSON is handed over as ``{"unreadable": text}`` instead of
failing the load."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    tbl   TEXT NOT NULL,
    key   TEXT NOT NULL,
    value TEXT NOT NULL,
    PRIMARY KEY (tbl, key)
) WITHOUT ROWID;
"""


class SqliteJournal(Journal):
    kind = "sqlite"

    def __init__(self, path: Path, sync: str = "normal"):
        self.path = path
        self.where = str(path)
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA synchronous={'FULL' if sync == 'full' else 'NORMAL'}")
        self.db.executescript(_SCHEMA)
        self.writes = 0

    def load(self) -> Tables:
        tables: Tables = {}
        for tbl, key, value in self.db.execute("SELECT tbl, key, value FROM records"):
            try:
                rec = json.loads(value)
            except ValueError as e:
                if tbl not in LENIENT_TABLES:
                    raise CannotStart(
                        f"journal {self.path} is damaged: record {tbl}/{key} is not JSON ({e}). "
                        f"Restore the journal from a backup, or start with --fresh to set it "
                        f"aside and begin the job again at epoch 1."
                    ) from None
                rec = {"unreadable": value}  # deleted by the restore with its table
            tables.setdefault(tbl, {})[key] = rec
        return tables

    def write(self, changes: list[Change]) -> None:
        """Apply a batch of changes atomically. Later changes to a key win."""
        if not changes:
            return
        last = last_wins(changes)
        puts = [(t, k, encode(r)) for (t, k), r in last.items() if r is not None]
        dels = [(t, k) for (t, k), r in last.items() if r is None]
        cur = self.db.cursor()
        cur.execute("BEGIN IMMEDIATE")
        try:
            if puts:
                cur.executemany("INSERT OR REPLACE INTO records VALUES (?, ?, ?)", puts)
            if dels:
                cur.executemany("DELETE FROM records WHERE tbl = ? AND key = ?", dels)
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        self.writes += 1

    def close(self) -> None:
        self.db.close()

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

import sqlite3
from pathlib import Path

from phalanx.controller.core.base import Change
from phalanx.controller.core.codec import encode
from phalanx.controller.journal.base import Journal, Tables, decode, last_wins

_FIX = (
    "Restore the journal from a backup, or start with --fresh to set it aside and begin "
    "the job again at epoch 1."
)

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
            tables.setdefault(tbl, {})[key] = decode(self.where, tbl, key, value, _FIX)
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

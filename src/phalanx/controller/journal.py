"""Durable controller state: a SQLite journal (WAL) in the job's state dir.

The state machine reports every durable change as ``(table, key, record)``;
:meth:`Journal.write` applies one batch of them in a single transaction,
and the server answers the request only after it returns. A controller
killed with SIGKILL and restarted on the same state dir reads the tables
back with :meth:`Journal.load`.

``synchronous=NORMAL`` (the default) survives the controller process
being killed at any instant: a committed WAL frame is in the OS page cache.
``synchronous=FULL`` also survives a power loss, at one fsync per write.

The state dir also holds ``controller.lock``: an exclusive ``flock`` held
for the controller's lifetime, so that two controllers on one state dir
are refused instead of corrupting each other's view.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
from pathlib import Path
from typing import Any

from phalanx.controller import StateDirLocked
from phalanx.controller.core.base import Change
from phalanx.controller.core.codec import encode

LENIENT_TABLES = ("rq_items",)
"""Tables whose records are checked by their reader (a checksum), which sets a damaged
one aside: a record there that is not even JSON is handed over as ``{"unreadable": text}``
instead of failing the load."""

__all__ = ["Change", "Journal", "StateDirLock", "StateDirLocked", "encode"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    tbl   TEXT NOT NULL,
    key   TEXT NOT NULL,
    value TEXT NOT NULL,
    PRIMARY KEY (tbl, key)
) WITHOUT ROWID;
"""


class StateDirLock:
    """Exclusive lock on a state dir, released when the process exits (even by SIGKILL)."""

    def __init__(self, state_dir: Path):
        self.path = state_dir / "controller.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StateDirLocked(
                f"state dir {self.path.parent} must be used by one controller at a time: it is "
                f"held by another controller ({holder}). Stop that controller, or start this "
                f"one with a different --state-dir."
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}".encode())
        self._fd = fd

    def note(self, text: str) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, text.encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


class Journal:
    def __init__(self, path: Path, sync: str = "normal"):
        self.path = path
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute(f"PRAGMA synchronous={'FULL' if sync == 'full' else 'NORMAL'}")
        self.db.executescript(_SCHEMA)
        self.writes = 0

    def load(self) -> dict[str, dict[str, dict[str, Any]]]:
        tables: dict[str, dict[str, dict[str, Any]]] = {}
        for tbl, key, value in self.db.execute("SELECT tbl, key, value FROM records"):
            try:
                rec = json.loads(value)
            except ValueError:
                if tbl not in LENIENT_TABLES:
                    raise
                rec = {"unreadable": value}  # its reader quarantines it (queue_book.py)
            tables.setdefault(tbl, {})[key] = rec
        return tables

    def write(self, changes: list[Change]) -> None:
        """Apply a batch of changes atomically. Later changes to a key win."""
        if not changes:
            return
        last: dict[tuple[str, str], dict[str, Any] | None] = {}
        for tbl, key, rec in changes:
            last[(tbl, key)] = rec
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

"""A job moved from the SQLite journal to etcd keeps its state: the first controller on
an empty etcd prefix whose state dir holds the job's ``journal.sqlite`` writes that
journal's rows into etcd before it loads (one atomic batch: a large one is staged and
committed as the etcd journal writes any tick too large for one transaction), then sets
the file aside as ``journal.sqlite.moved-to-etcd``, so that nothing resumes from it
later by mistake. A prefix that holds rows already is the job's: the file is left
alone, and a warning says that it was not read."""

from __future__ import annotations

import logging
from pathlib import Path

from phalanx.controller.core.base import Change
from phalanx.controller.journal.etcd import EtcdJournal
from phalanx.controller.journal.sqlite import SqliteJournal

log = logging.getLogger("phalanx.controller")

MOVED = ".moved-to-etcd"
"""The suffix the SQLite journal gets once carried over."""


def carry_over(sqlite_path: Path, journal: EtcdJournal) -> int:
    """Carry the SQLite journal at ``sqlite_path`` (if there is one) into ``journal``'s
    prefix if that is empty; returns the rows carried (0: nothing was)."""
    if not sqlite_path.exists():
        return 0
    if not journal.empty():
        log.warning(
            "the state dir holds %s, which was not read: etcd journal %s holds the job "
            "already (delete or move the file to silence this)",
            sqlite_path,
            journal.where,
        )
        return 0
    lite = SqliteJournal(sqlite_path)
    try:
        tables = lite.load()
    finally:
        lite.close()
    rows: list[Change] = [
        (tbl, key, rec) for tbl, recs in tables.items() for key, rec in recs.items()
    ]
    if not rows:
        return 0
    journal.write(rows)
    moved = sqlite_path.with_name(sqlite_path.name + MOVED)
    for suffix in ("", "-wal", "-shm"):
        side = sqlite_path.with_name(sqlite_path.name + suffix)
        if side.exists():
            side.rename(moved.with_name(moved.name + suffix))
    log.warning(
        "carried the SQLite journal %s (%d rows) over to etcd journal %s; the file is kept as %s",
        sqlite_path,
        len(rows),
        journal.where,
        moved.name,
    )
    return len(rows)

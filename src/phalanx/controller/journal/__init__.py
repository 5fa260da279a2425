"""The controller's journal (``controller.journal``): the interface (``base.py``), the
embedded SQLite file (``sqlite.py``) and the etcd cluster (``etcd.py``, imported only
when a job names one). :func:`open_journal` opens the one a config names."""

from __future__ import annotations

from pathlib import Path

from phalanx.config import JobConfig
from phalanx.controller.core.base import Change
from phalanx.controller.core.codec import encode
from phalanx.controller.journal.base import Deposed, Journal, JournalUnavailable, Tables
from phalanx.controller.journal.sqlite import SqliteJournal

__all__ = [
    "Change",
    "Deposed",
    "Journal",
    "JournalUnavailable",
    "SqliteJournal",
    "Tables",
    "encode",
    "open_journal",
]


def open_journal(cfg: JobConfig, path: Path, leader_url: str) -> Journal:
    """The journal ``cfg.controller.journal`` names: the SQLite file at ``path``, or
    the etcd cluster, whose leader key this controller (serving at ``leader_url``)
    takes. Raises :class:`~phalanx.controller.statedir.CannotStart` in one line when
    etcd does not answer, holds another job at the prefix, or has a live leader."""
    ctl = cfg.controller
    if ctl.journal == "sqlite":
        return SqliteJournal(path, ctl.journal_sync)
    from phalanx.config.journal import target_of
    from phalanx.controller.journal.etcd import EtcdJournal

    return EtcdJournal(target_of(ctl), cfg.job.id, leader_url)

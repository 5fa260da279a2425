"""The controller's state dir, checked before a controller starts on it.

It holds ``journal.sqlite`` (the state; with ``controller.journal = "etcd://..."`` the
state is in etcd and this file is neither written nor checked), ``payloads/`` (the
payload log), ``token``, ``config.json`` (the resolved job config, written once the
journal holds the job), ``url`` and ``controller.lock``; every file is the owner's
alone (mode 0600: the journal holds the job's rollouts and the config its storage
options).

A journal is never replaced behind the operator's back: a dir whose ``config.json``
says a job ran here, but whose journal is missing, empty or unreadable, is refused
with a line that names the file. ``--fresh`` moves the damaged state aside (nothing
is deleted) and starts the job over at epoch 1.
"""

from __future__ import annotations

import os
import secrets
import sqlite3
import time
from pathlib import Path

from phalanx import env

JOURNAL = "journal.sqlite"
CONFIG = "config.json"
TOKEN_FILE = "token"
URL_FILE = "url"
PAYLOADS = "payloads"
PRIVATE = 0o600


class CannotStart(RuntimeError):
    """The controller cannot start as asked (its state dir, --host or --port). The
    message says what was wrong and what to do."""


def prepare(state_dir: Path) -> None:
    """Create the state dir (mode 0700) if it is new; refuse a path that is not a dir.
    Files an older version left readable by others are made the owner's alone."""
    if state_dir.exists() and not state_dir.is_dir():
        raise CannotStart(
            f"--state-dir {state_dir} must be a directory: it is a file. Name a directory "
            f"(it is created if it does not exist)."
        )
    try:
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise CannotStart(
            f"--state-dir {state_dir} cannot be created: {e.strerror or e}. Name a directory "
            f"this user may write."
        ) from None
    for name in (JOURNAL, f"{JOURNAL}-wal", f"{JOURNAL}-shm", CONFIG, TOKEN_FILE, URL_FILE):
        p = state_dir / name
        if p.is_file() and p.stat().st_mode & 0o077:
            p.chmod(PRIVATE)
    for p in (state_dir / PAYLOADS).glob("*"):
        if p.is_file() and p.stat().st_mode & 0o077:
            p.chmod(PRIVATE)


def write_private(path: Path, text: str) -> None:
    """Replace ``path`` atomically with ``text``, mode 0600."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def load_or_create_token(state_dir: Path) -> str:
    """The job token: ``$PHALANX_TOKEN`` if set, else the state dir's token file,
    created at first start. Either way ``STATE_DIR/token`` (0600) holds it afterwards,
    for the tools that are pointed at the state dir."""
    path = state_dir / TOKEN_FILE
    given = os.environ.get(env.TOKEN, "").strip()
    if given:
        if not path.is_file() or path.read_text().strip() != given:
            write_private(path, given + "\n")
        return given
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE)
    except FileExistsError:
        token = path.read_text().strip()
        if not token:
            raise CannotStart(
                f"token file {path} must hold the job token: it is empty. Delete it to have a "
                f"new token generated, or set ${env.TOKEN}."
            ) from None
        return token
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def check_journal(state_dir: Path, fresh: bool) -> str | None:
    """Refuse a journal that cannot be the job's state; with ``fresh``, move it aside.
    Returns a note to print when something was moved aside."""
    journal = state_dir / JOURNAL
    problem = journal_problem(state_dir)
    if problem is None:
        return None
    problem = " ".join(problem.split())  # SQLite's reports span lines
    if not fresh:
        raise CannotStart(
            f"journal {journal} {problem}, but {state_dir / CONFIG} says a job ran in this state "
            f"dir. Restore the journal from a backup, or start with --fresh to set the damaged "
            f"state aside and begin the job again at epoch 1 (its members, leases and queued "
            f"rollouts are not carried over)."
        )
    aside = state_dir / time.strftime("set-aside-%Y%m%dT%H%M%SZ", time.gmtime())
    aside.mkdir(mode=0o700, exist_ok=True)
    moved = []
    for name in (JOURNAL, f"{JOURNAL}-wal", f"{JOURNAL}-shm", PAYLOADS, CONFIG):
        if (state_dir / name).exists():
            os.replace(state_dir / name, aside / name)
            moved.append(name)
    return f"--fresh: journal {journal} {problem}; moved {', '.join(moved)} to {aside}"


def journal_problem(state_dir: Path) -> str | None:
    """What makes the journal unusable (None: nothing, or no job ran here yet).
    Reads it as SQLite, without writing, down to the integrity of its pages."""
    journal = state_dir / JOURNAL
    if not journal.exists():
        return "is missing" if (state_dir / CONFIG).exists() else None
    if journal.stat().st_size == 0:
        return "is empty (0 bytes)" if (state_dir / CONFIG).exists() else None
    try:
        db = sqlite3.connect(f"file:{journal}?mode=ro", uri=True)
        try:
            check = db.execute("PRAGMA quick_check").fetchone()
            if check is None or check[0] != "ok":
                return f"is damaged (SQLite integrity check: {check[0] if check else 'no answer'})"
            has = "SELECT 1 FROM sqlite_master WHERE type='table' AND name='records'"
            get = "SELECT value FROM records WHERE tbl='meta' AND key='epoch'"
            row = db.execute(get).fetchone() if db.execute(has).fetchone() else None
        finally:
            db.close()
    except sqlite3.DatabaseError as e:
        return f"is not a readable SQLite journal ({e})"
    if row is None and (state_dir / CONFIG).exists():
        return "holds no job state (no epoch record)"
    return None

"""The tokenization cache: one directory per tokenized split, built once.

An entry is a directory named after a digest of its *key* (a JSON object: the data
files' identity, the tokenizer's, and every setting that shapes the samples). It
holds ``.npy`` arrays, read memory-mapped, and ``meta.json``, which repeats the key
and is written last. Entries are built in a temporary directory beside the final one
and renamed into place, so a reader sees a whole entry or none, whatever dies when.

Several replicas of a job start at once and would all tokenize the same data. A
lock file beside the entry (``<entry>.lock``, ``fcntl.flock``) makes the first one
build it while the others wait and then read it; a process that dies while it
holds the lock releases it with its file descriptors, and the next waiter builds
the entry instead. Nothing but the key decides whether an entry fits, so a
different tokenizer or setting simply lands in another entry.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from phalanx import env

log = logging.getLogger("phalanx.data.cache")

META = "meta.json"
VERSION = 1
"""Bumped when the entries' layout or the tokenization rules change."""
WAIT_LOG_S = 30.0
"""Seconds between the lines a waiting process logs."""


def cache_root(configured: str) -> Path:
    """``train.data.cache_dir``, else ``$PHALANX_RUN_DIR/data-cache``, else
    ``~/.cache/phalanx/data``."""
    if configured:
        return Path(configured).expanduser()
    run_dir = os.environ.get(env.RUN_DIR)
    if run_dir:
        return Path(run_dir) / "data-cache"
    return Path.home() / ".cache" / "phalanx" / "data"


def normal(key: dict[str, Any]) -> dict[str, Any]:
    """``key`` as it reads back from JSON (tuples become lists), for comparison."""
    return dict(json.loads(json.dumps(key, sort_keys=True)))


def entry_dir(root: Path, name: str, key: dict[str, Any]) -> Path:
    """The entry of ``key`` under ``root``: a readable ``name`` and the key's digest."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:60]
    return root / f"{safe}-{digest}"


def read_meta(entry: Path, key: dict[str, Any]) -> dict[str, Any] | None:
    """The meta of a complete entry made for ``key``; None when there is none (absent,
    incomplete, or made for another key)."""
    try:
        meta = json.loads((entry / META).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("key") != normal(key):
        return None
    if not all((entry / f).is_file() for f in meta.get("arrays", [])):
        return None
    return meta


class TokenFile:
    """The token stream of an entry being built: int32 tokens appended to a raw file,
    then turned into an ``.npy`` array (without holding them all in memory)."""

    def __init__(self, path: Path):
        self.path = path
        self._f: BinaryIO = open(path, "wb")  # noqa: SIM115 (closed by to_npy)
        self.count = 0
        self.max_id = -1

    def write(self, ids: np.ndarray) -> None:
        if ids.size:
            self._f.write(np.ascontiguousarray(ids, dtype="<i4").tobytes())
            self.count += int(ids.size)
            self.max_id = max(self.max_id, int(ids.max()))

    def to_npy(self, npy: Path, shape: tuple[int, ...]) -> None:
        """Write the first ``prod(shape)`` tokens to ``npy`` with that shape, then
        remove the raw file."""
        self._f.close()
        n = int(np.prod(shape))
        out = np.lib.format.open_memmap(npy, mode="w+", dtype="<i4", shape=shape)
        if n:
            raw = np.memmap(self.path, dtype="<i4", mode="r", shape=(self.count,))
            step = 1 << 24  # copy in pieces: the stream may not fit in memory
            flat = out.reshape(-1)
            for i in range(0, n, step):
                flat[i : i + step] = raw[i : min(n, i + step)]
            del raw
        out.flush()
        del out
        self.path.unlink()


def _fsync_tree(d: Path) -> None:
    for f in d.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextmanager
def locked(path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if absent), logging who holds
    it every :data:`WAIT_LOG_S` seconds while waiting. The lock has no timeout: its
    holder's death releases it, and a holder that is alive is doing the work."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        start = last = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now - last >= WAIT_LOG_S:
                    holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
                    log.info(
                        "waiting %.0f s for %s to %s (lock %s)", now - start, holder, what, path
                    )
                    last = now
                time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{socket.gethostname()} pid {os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def build_once(
    entry: Path, key: dict[str, Any], build: Callable[[Path], dict[str, Any]]
) -> dict[str, Any]:
    """The meta of ``entry``, built first when it is absent or made for another key.

    ``build(tmp)`` writes the entry's arrays into the empty directory ``tmp`` and
    returns its meta, with ``arrays`` naming the files it wrote; ``key`` is added
    to it. Exactly one process builds an entry at a time; the others wait for it and
    then read it. An exception from ``build`` leaves no entry behind."""
    meta = read_meta(entry, key)
    if meta is not None:
        return meta
    entry.parent.mkdir(parents=True, exist_ok=True)
    with locked(entry.with_name(entry.name + ".lock"), f"build {entry.name}"):
        meta = read_meta(entry, key)
        if meta is not None:
            return meta
        # Under the lock nobody else builds this entry: leftovers are from the dead.
        for stale in entry.parent.glob(f".tmp-{entry.name}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = entry.with_name(f".tmp-{entry.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        tmp.mkdir()
        try:
            meta = {**build(tmp), "key": normal(key)}
            (tmp / META).write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
            _fsync_tree(tmp)
            if entry.exists():  # made for a key of the same digest, or damaged
                shutil.rmtree(entry)
            os.rename(tmp, entry)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return meta

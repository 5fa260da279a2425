"""The controller's payload log: where the ``controller`` rollout store keeps rollout
payloads, apart from the journal.

The journal records what the ledger decides (ids, versions,
states: a few hundred bytes per rollout); the completions themselves (token
ids, log-probs, rewards: kilobytes to megabytes per rollout) are written
here, once, and dropped when the rollout is trained or discarded.
So the journal's size and its transactions do not grow with the length of
the completions, and a payload is never rewritten as its rollout moves
through the ledger.

On disk, ``STATE_DIR/payloads/seg-<n>.log``: append-only segments of framed
records ``[b"PXP1"][u32 length][u32 crc32][JSON {"k": key, "v": payload}]``.
A segment whose every record was dropped is deleted; a new one is started
past :data:`SEGMENT_BYTES`. In memory, every payload that is still held, by
key.

Durability, with the journal's: the service writes a call's payloads here
*before* it commits the call's journal transaction, with the same sync level
(``controller.journal_sync``: ``normal`` survives the process being killed,
``full`` fsyncs and survives a power loss). At a restart the log is read back
whole, and the journal decides: a payload the records do not refer to (its
journal transaction never committed) is dropped, and a record whose payload
is missing or fails its checksum is counted and handled by its owner (the
ledger dispatches the prompt again).
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

from phalanx.controller.core.codec import encode_bytes

log = logging.getLogger("phalanx.controller")

MAGIC = b"PXP1"
HEADER = struct.Struct("<4sII")
SEGMENT_BYTES = 64 << 20
"""A new segment is started once the current one is past this size."""


def frame(key: str, payload: Any) -> bytes:
    body = encode_bytes({"k": key, "v": payload})
    return HEADER.pack(MAGIC, len(body), zlib.crc32(body)) + body


def unframe(blob: bytes) -> tuple[list[tuple[str, Any]], int]:
    """The (key, payload) records of a segment, and how many damaged spans it has
    (a torn last write, a flipped bit): each is skipped up to the next marker."""
    import json

    good: list[tuple[str, Any]] = []
    bad = 0
    pos = 0
    while pos < len(blob):
        try:
            magic, n, want = HEADER.unpack_from(blob, pos)
            body = blob[pos + HEADER.size : pos + HEADER.size + n]
            if magic != MAGIC or len(body) != n or zlib.crc32(body) != want:
                raise ValueError
            rec = json.loads(body)
            good.append((str(rec["k"]), rec["v"]))
        except (struct.error, ValueError, KeyError, TypeError, UnicodeDecodeError):
            nxt = blob.find(MAGIC, pos + 1)
            bad += 1
            pos = len(blob) if nxt < 0 else nxt
            continue
        pos += HEADER.size + n
    return good, bad


class PayloadLog:
    """Payloads by key: in memory, and in append-only segments on disk."""

    def __init__(self, root: Path, sync: str = "normal", segment_bytes: int = SEGMENT_BYTES):
        self.root = root
        self.fsync = sync == "full"
        self.segment_bytes = segment_bytes
        self.items: dict[str, tuple[Any, int]] = {}
        """key -> (payload, the segment that holds it)."""
        self.live: Counter[int] = Counter()
        """Held payloads per segment."""
        self.counts = {"put": 0, "dropped": 0, "corrupt": 0, "bytes": 0}
        self._seg = 0
        self._fd: int | None = None
        self._size = 0

    # -- start -----------------------------------------------------------

    def load(self) -> int:
        """Read every segment back (the newest record of a key wins). Returns the
        number of payloads held. Call once, before any put."""
        self.root.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.root.glob("seg-*.log")):
            n = int(path.stem.removeprefix("seg-"))
            self._seg = max(self._seg, n)
            good, bad = unframe(path.read_bytes())
            if bad:
                log.warning("payload log %s: %d damaged record(s) skipped", path, bad)
                self.counts["corrupt"] += bad
            for key, payload in good:
                self._forget(key)
                self.items[key] = (payload, n)
                self.live[n] += 1
            if not good:  # nothing readable: keep the bytes aside for a person to look at
                path.rename(path.with_suffix(".damaged"))
        return len(self.items)

    def retain(self, keys: set[str]) -> int:
        """Drop every payload whose key is not in ``keys`` (what the journal refers
        to). Returns how many were dropped."""
        gone = [k for k in self.items if k not in keys]
        self.drop(gone)
        return len(gone)

    # -- requests --------------------------------------------------------

    def get(self, key: str) -> Any:
        it = self.items.get(key)
        return None if it is None else it[0]

    def put(self, items: list[tuple[str, Any]]) -> None:
        """Append payloads (one write), then hold them. Raises OSError if the disk
        refuses: the caller must not commit the journal then."""
        if not items:
            return
        blob = b"".join(frame(k, v) for k, v in items)
        fd = self._open(len(blob))
        view = memoryview(blob)
        while view:
            view = view[os.write(fd, view) :]
        if self.fsync:
            os.fsync(fd)
        self._size += len(blob)
        self.counts["bytes"] += len(blob)
        for k, v in items:
            self._forget(k)
            self.items[k] = (v, self._seg)
            self.live[self._seg] += 1
        self.counts["put"] += len(items)

    def drop(self, keys: list[str]) -> None:
        for k in keys:
            if self._forget(k):
                self.counts["dropped"] += 1

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def stats(self) -> dict[str, int]:
        return {"held": len(self.items), "segments": len(self.live), **self.counts}

    # -- segments --------------------------------------------------------

    def _path(self, seg: int) -> Path:
        return self.root / f"seg-{seg:08d}.log"

    def _open(self, adding: int) -> int:
        if self._fd is not None and self._size + adding > self.segment_bytes and self._size:
            os.close(self._fd)
            self._fd = None
            if self.live[self._seg] == 0:
                self._delete(self._seg)
        if self._fd is None:
            self.root.mkdir(parents=True, exist_ok=True)
            self._seg += 1
            self._fd = os.open(self._path(self._seg), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._size = 0
        return self._fd

    def _forget(self, key: str) -> bool:
        it = self.items.pop(key, None)
        if it is None:
            return False
        seg = it[1]
        self.live[seg] -= 1
        if self.live[seg] <= 0:
            del self.live[seg]
            if seg != self._seg or self._fd is None:
                self._delete(seg)
        return True

    def _delete(self, seg: int) -> None:
        self.live.pop(seg, None)
        try:
            self._path(seg).unlink()
        except FileNotFoundError:
            pass

"""A rollout queue spooled on storage: any fsspec URL (``file://``, ``s3://``, ``memory://``).

Layout under the spool's root (``<url>/<name>``: a job's runs stay apart)::

    segments/<ns>-<producer>-<seq>.seg   one put: immutable once its name appears
    leases/<rid>@<k>                     attempt k of rid is taken (created exclusively)
    leases/<rid>@<k>@<deadline ms>       ... until then (0: given back early, a nack)
    acks/<rid>                           rid is consumed or discarded (exclusive: first wins)
    discards/<reason>/<rid>              ... discarded, and why (counted by listing)
    quarantine/<segment>@<offset>        the bytes of a corrupt record (counted by listing)

A segment is a run of records ``[b"PXR1"][u32 length][u32 crc32][JSON]``. It
is written under a temporary name and renamed when complete, so a reader
sees all of it or none of it; a record damaged later (a torn disk write, a
bad copy) fails its checksum or its length, and the reader quarantines the
bytes up to the next record marker and goes on: the consumer never crashes
on it, and the loss is counted.

Leases are markers, not locks: taking attempt ``k + 1`` of a rollout whose
attempt ``k`` has expired is an exclusive create, so two consumers never hold
the same attempt, and a dead consumer's rollouts go to the next one after its
deadline. Every consumer deduplicates by rollout id: an id with an ack marker
is never delivered again (checked again after taking the lease, which closes
the race with a concurrent ack), and a second record of the same id is
skipped. Deadlines are wall-clock times: consumers' clocks must roughly agree
(to well within ``lease_s``).

The ack marker is the one place a rollout is consumed: of the consumers that
settle an id (its holder, and one whose lease expired before it acked), the
one that creates the marker counts it, every other is told 0. Each marker
holds a token of the call that created it, so that a create whose request
landed but whose reply was lost (s3fs and botocore retry after a read timeout
or a dropped connection, and the retry finds the object) is known to be this
call's own by reading the token back, not mistaken for another consumer's.

All of this needs a store whose create-if-absent is atomic: POSIX
``O_EXCL`` (``file://``), S3's ``If-None-Match: *`` (AWS since 2024; a write
that races another gets 409 ``ConditionalRequestConflict``, and is sent
again), GCS's generation match. moto's server is not: it checks for the key
and then writes it, in threads with no lock between, so two concurrent
creates can both succeed there (two consumers then hold one attempt, and may
both count an ack).

Segments whose records are all acked are deleted, unless ``keep_segments``
keeps them for off-policy reuse (:meth:`SpoolRolloutQueue.records`). Ack
markers stay for the life of the spool, to recognise late duplicates.
"""

from __future__ import annotations

import errno
import json
import struct
import time
import uuid
import zlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import quote, unquote

import fsspec

from phalanx.transport.base import Delivery, RolloutQueue, TransportError

MAGIC = b"PXR1"
HEADER = struct.Struct("<4sII")
CONFLICT_TRIES = 6
"""Sends of an exclusive create that S3 answered with a conflict (backoff 0.05 s, doubling)."""


def encode(rollout: Mapping[str, Any]) -> bytes:
    """One framed record."""
    data = json.dumps(rollout, separators=(",", ":")).encode()
    return HEADER.pack(MAGIC, len(data), zlib.crc32(data)) + data


def decode(blob: bytes) -> tuple[list[tuple[int, dict[str, Any]]], list[tuple[int, int]]]:
    """The records of a segment as (offset, rollout), and the corrupt spans (start, end)."""
    good: list[tuple[int, dict[str, Any]]] = []
    bad: list[tuple[int, int]] = []
    pos = 0
    while pos < len(blob):
        try:
            magic, n, want = HEADER.unpack_from(blob, pos)
            body = blob[pos + HEADER.size : pos + HEADER.size + n]
            if magic != MAGIC or len(body) != n or zlib.crc32(body) != want:
                raise ValueError
            rollout = json.loads(body)
            if not isinstance(rollout, dict) or not isinstance(rollout.get("rollout_id"), str):
                raise ValueError
        except (struct.error, ValueError, UnicodeDecodeError):
            # Resynchronise on the next record marker: whatever lies between is lost.
            nxt = blob.find(MAGIC, pos + 1)
            end = len(blob) if nxt < 0 else nxt
            bad.append((pos, end))
            pos = end
            continue
        good.append((pos, rollout))
        pos += HEADER.size + n
    return good, bad


def _key(name: str) -> str:
    return quote(name, safe=".-_")


def _conflict(e: OSError) -> bool:
    """Whether the store refused a write for a concurrent one, so that sending it again
    settles it: S3's 409 ``ConditionalRequestConflict`` (s3fs raises OSError EIO, the
    botocore error as its cause), or a busy store (EBUSY: s3fs's 409, SlowDown)."""
    response = getattr(e.__cause__, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return (
        e.errno == errno.EBUSY
        or code == "ConditionalRequestConflict"
        or "ConditionalRequestConflict" in str(e)
    )


class SpoolRolloutQueue(RolloutQueue):
    def __init__(
        self,
        url: str,
        consumer: str = "",
        *,
        name: str = "",
        lease_s: float = 30.0,
        keep_segments: bool = False,
        poll_s: float = 0.05,
        storage_options: Mapping[str, Any] | None = None,
    ):
        self.fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        self.root = f"{root.rstrip('/')}/{name}" if name else root.rstrip("/")
        self.url, self.consumer = url, consumer or uuid.uuid4().hex[:8]
        self.lease_s, self.keep_segments, self.poll_s = lease_s, keep_segments, poll_s
        for d in ("segments", "leases", "acks", "discards", "quarantine"):
            self.fs.makedirs(f"{self.root}/{d}", exist_ok=True)
        self._producer, self._seq = uuid.uuid4().hex[:8], 0
        self._segs: dict[str, list[str]] = {}
        """Segments read so far -> the rollout ids first seen in them."""
        self._data: dict[str, dict[str, Any]] = {}
        """Rollouts not known to be acked, by id, in segment order."""
        self._acked: set[str] = set()
        self._seen: dict[str, float] = {}
        """Monotonic time a lease marker without a deadline was first seen."""
        self.duplicates = 0
        """Second records of an id this process skipped (not shared between processes)."""

    # -- storage helpers -------------------------------------------------

    def _ls(self, sub: str) -> list[str]:
        try:
            names = self.fs.ls(f"{self.root}/{sub}", detail=False, refresh=True)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise TransportError(f"spool {self.url}: cannot list {sub}: {e}") from e
        return [n.rstrip("/").rsplit("/", 1)[-1] for n in names]

    def _create(self, path: str, data: bytes | None = None) -> bool:
        """Create ``path`` only if absent; True if this call created it (atomically
        where the filesystem can). Without ``data`` the marker holds a fresh token of
        this call: if the store says the path exists, the token read back tells
        whether this call's own earlier request made it (its reply lost, the client
        retried) or another consumer did."""
        # Never empty: s3fs commits an empty file with a plain PUT (its touch), without
        # If-None-Match, so an empty "exclusive" create would overwrite a marker that
        # another consumer made (two consumers would hold one attempt).
        body = data if data is not None else f"{self.consumer} {uuid.uuid4().hex}".encode()
        tries = 0
        while True:
            try:
                with self.fs.open(path, "xb") as f:
                    f.write(body)
                return True
            except FileExistsError:
                return data is None and self._read(path) == body
            except (ValueError, NotImplementedError):
                # No exclusive create on this filesystem: best effort (check, then write).
                if self._exists_now(path):
                    return False
                self.fs.pipe_file(path, body)
                return True
            except OSError as e:
                tries += 1
                if not _conflict(e) or tries >= CONFLICT_TRIES:
                    raise TransportError(f"spool {self.url}: cannot create {path}: {e}") from e
                time.sleep(0.05 * 2 ** (tries - 1))

    def _read(self, path: str) -> bytes | None:
        """The bytes of ``path``, or None if it is gone (a collected lease marker)."""
        try:
            return bytes(self.fs.cat_file(path))
        except FileNotFoundError:
            return None
        except OSError as e:
            raise TransportError(f"spool {self.url}: cannot read {path}: {e}") from e

    def _exists_now(self, path: str) -> bool:
        """Whether ``path`` exists now, asking the store itself: s3fs answers ``exists``
        from the listing it cached, which misses what another process made since."""
        self.fs.invalidate_cache(path)
        return bool(self.fs.exists(path))

    # -- producer --------------------------------------------------------

    def put(self, rollouts: Sequence[Mapping[str, Any]]) -> list[str]:
        ids: list[str] = []
        blob = bytearray()
        for r in rollouts:
            rid = str(r["rollout_id"])
            if rid not in ids:
                ids.append(rid)
                blob += encode(r)
        if not ids:
            return []
        self._seq += 1
        name = f"{time.time_ns():020d}-{self._producer}-{self._seq:06d}.seg"
        tmp = f"{self.root}/segments/.tmp-{uuid.uuid4().hex}"
        try:
            self.fs.pipe_file(tmp, bytes(blob))
            self.fs.mv(tmp, f"{self.root}/segments/{name}")
        except OSError as e:
            raise TransportError(f"spool {self.url}: cannot write a segment: {e}") from e
        return ids

    # -- consumer --------------------------------------------------------

    def _refresh(self) -> None:
        names = sorted(n for n in self._ls("segments") if n.endswith(".seg"))
        for gone in set(self._segs) - set(names):
            for rid in self._segs.pop(gone):
                self._data.pop(rid, None)
        known = {rid for rids in self._segs.values() for rid in rids}
        for name in names:
            if name in self._segs:
                continue
            try:
                blob = self.fs.cat_file(f"{self.root}/segments/{name}")
            except FileNotFoundError:
                continue  # collected between the listing and the read
            good, bad = decode(blob)
            for start, end in bad:
                self._create(f"{self.root}/quarantine/{name}@{start}", blob[start:end])
            rids = []
            for _, r in good:
                rid = r["rollout_id"]
                if rid in known:
                    self.duplicates += 1
                    continue
                known.add(rid)
                rids.append(rid)
                self._data[rid] = r
            self._segs[name] = rids
        self._acked = {unquote(n) for n in self._ls("acks")}
        for rid in self._acked:
            self._data.pop(rid, None)

    def _leases(self) -> dict[str, tuple[int, float | None]]:
        """rid -> (newest attempt, its deadline or None if not written yet)."""
        top: dict[str, int] = {}
        deadlines: dict[tuple[str, int], float] = {}
        for n in self._ls("leases"):
            parts = n.split("@")
            rid, k = unquote(parts[0]), int(parts[1])
            top[rid] = max(top.get(rid, 0), k)
            if len(parts) == 3:
                ms = int(parts[2]) / 1e3
                deadlines[rid, k] = min(deadlines.get((rid, k), ms), ms)
        return {rid: (k, deadlines.get((rid, k))) for rid, k in top.items()}

    def lease(self, n: int, wait_s: float = 0.0) -> list[Delivery]:
        until = time.monotonic() + wait_s
        while True:
            out = self._lease_once(n)
            if out or time.monotonic() >= until:
                return out
            time.sleep(min(self.poll_s, max(0.0, until - time.monotonic())))

    def _lease_once(self, n: int) -> list[Delivery]:
        self._refresh()
        if not self._data:
            return []
        held = self._leases()
        now, mono = time.time(), time.monotonic()
        out: list[Delivery] = []
        for rid, rollout in list(self._data.items()):
            if len(out) >= n:
                break
            k, deadline = held.get(rid, (0, None))
            if k > 0:
                if deadline is None:
                    # Taken, deadline not written yet (or its taker died in between).
                    deadline = (
                        now + self.lease_s - (mono - self._seen.setdefault(f"{rid}@{k}", mono))
                    )
                if deadline > now:
                    continue
            key = _key(rid)
            if not self._create(f"{self.root}/leases/{key}@{k + 1}"):
                continue  # another consumer took this attempt first
            until = now + self.lease_s
            self._create(f"{self.root}/leases/{key}@{k + 1}@{int(until * 1e3)}")
            if self._exists_now(f"{self.root}/acks/{key}"):
                self._acked.add(rid)  # acked since our listing: never deliver it again
                self._data.pop(rid, None)
                continue
            out.append(Delivery(rid, rollout, str(k + 1), k + 1, until))
        return out

    def _settle(self, deliveries: Sequence[Delivery], reason: str | None) -> int:
        n = 0
        for d in deliveries:
            key = _key(d.rollout_id)
            # The reason is recorded under discards/; the marker holds this call's token.
            if self._create(f"{self.root}/acks/{key}"):
                n += 1
                if reason is not None:
                    self.fs.makedirs(f"{self.root}/discards/{_key(reason)}", exist_ok=True)
                    self._create(f"{self.root}/discards/{_key(reason)}/{key}")
            self._acked.add(d.rollout_id)
            self._data.pop(d.rollout_id, None)
        self._collect()
        return n

    def ack(self, deliveries: Sequence[Delivery]) -> int:
        return self._settle(deliveries, None)

    def discard(self, deliveries: Sequence[Delivery], reason: str) -> int:
        return self._settle(deliveries, reason)

    def nack(self, deliveries: Sequence[Delivery]) -> int:
        for d in deliveries:
            self._create(f"{self.root}/leases/{_key(d.rollout_id)}@{d.attempt}@0")
        return len(deliveries)

    def _collect(self) -> None:
        """Delete segments whose every record is acked (unless kept), with their leases."""
        if self.keep_segments:
            return
        for name, rids in list(self._segs.items()):
            if all(rid in self._acked for rid in rids):
                try:
                    self.fs.rm_file(f"{self.root}/segments/{name}")
                except FileNotFoundError:
                    pass  # another consumer collected it
                del self._segs[name]
                keys = {_key(rid) for rid in rids}
                for m in self._ls("leases") if keys else []:
                    if m.split("@")[0] in keys:
                        try:
                            self.fs.rm_file(f"{self.root}/leases/{m}")
                        except FileNotFoundError:
                            pass

    def pending(self) -> int:
        self._refresh()
        return len(self._data)

    def counts(self) -> dict[str, Any]:
        discarded = {unquote(r): len(self._ls(f"discards/{r}")) for r in self._ls("discards")}
        settled = len(self._ls("acks"))
        return {
            "acked": settled - sum(discarded.values()),
            "discarded": {k: v for k, v in sorted(discarded.items()) if v},
            "corrupt": len(self._ls("quarantine")),
            "duplicates": self.duplicates,
        }

    def records(self) -> Iterator[dict[str, Any]]:
        """Every valid record of the segments still stored (acked ones too, when
        ``keep_segments``): for off-policy reuse."""
        for name in sorted(n for n in self._ls("segments") if n.endswith(".seg")):
            try:
                blob = self.fs.cat_file(f"{self.root}/segments/{name}")
            except FileNotFoundError:
                continue
            for _, r in decode(blob)[0]:
                yield r

"""A rollout store on storage: any fsspec URL (``file://``, ``s3://``, ``gs://``).

Layout under ``<url>/<name>`` (``name``: the job id and the ledger's run)::

    payloads/<ref>                 one payload: [b"PXS1"][u32 length][u32 crc32][JSON]
    dropped/<reason>/<ref>         an empty marker per dropped payload (the counts)
    quarantine/<ref>               a payload that failed its checksum, set aside

One object per payload, written once under a fresh ref, so no reader ever
sees another writer's bytes, and a drop is one delete. A put of several
payloads writes them concurrently where the filesystem can (s3fs does).
The counts are listings: ``put`` is what is held, dropped or set aside.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import quote

import fsspec
from pydantic import ValidationError

from phalanx.protocol.rl import RolloutPayload
from phalanx.transport.base import RolloutStore, TransportError, new_ref

MAGIC = b"PXS1"
HEADER = struct.Struct("<4sII")


def frame(payload: RolloutPayload) -> bytes:
    data = payload.model_dump_json().encode()
    return HEADER.pack(MAGIC, len(data), zlib.crc32(data)) + data


def unframe(blob: bytes) -> RolloutPayload:
    """The payload of one object; ValueError if it is damaged."""
    try:
        magic, n, want = HEADER.unpack_from(blob, 0)
    except struct.error:
        raise ValueError("truncated header") from None
    data = blob[HEADER.size :]
    if magic != MAGIC or len(data) != n or zlib.crc32(data) != want:
        raise ValueError("bad frame or checksum")
    try:
        return RolloutPayload.model_validate_json(data)
    except ValidationError as e:
        raise ValueError(f"not a rollout payload: {e.error_count()} error(s)") from None


class StorageRolloutStore(RolloutStore):
    def __init__(self, url: str, name: str, storage_options: Mapping[str, Any] | None = None):
        self.url = url
        self.fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        self.root = f"{root.rstrip('/')}/{quote(name, safe='.-_')}"
        try:
            for d in ("payloads", "dropped", "quarantine"):
                self.fs.makedirs(f"{self.root}/{d}", exist_ok=True)
        except OSError as e:
            raise TransportError(f"rollout store {url}: cannot create {self.root}: {e}") from e

    def _path(self, ref: str) -> str:
        return f"{self.root}/payloads/{ref}"

    def _ls(self, sub: str) -> list[str]:
        try:
            names = self.fs.ls(f"{self.root}/{sub}", detail=False, refresh=True)
        except FileNotFoundError:
            return []
        except OSError as e:
            raise TransportError(f"rollout store {self.url}: cannot list {sub}: {e}") from e
        return [n.rstrip("/").rsplit("/", 1)[-1] for n in names]

    def put(self, payloads: Sequence[RolloutPayload]) -> list[str]:
        refs = [new_ref(p.rollout_id) for p in payloads]
        if refs:
            blobs = {self._path(r): frame(p) for r, p in zip(refs, payloads, strict=True)}
            try:
                self.fs.pipe(blobs)
            except OSError as e:
                raise TransportError(f"rollout store {self.url}: cannot write: {e}") from e
        return refs

    def get(self, refs: Sequence[str]) -> tuple[dict[str, RolloutPayload], dict[str, str]]:
        if not refs:
            return {}, {}
        paths = [self._path(r) for r in refs]
        try:
            blobs = self.fs.cat(paths, on_error="omit")
        except OSError as e:
            raise TransportError(f"rollout store {self.url}: cannot read: {e}") from e
        by_path = {p.rstrip("/").rsplit("/", 1)[-1]: b for p, b in blobs.items()}
        found: dict[str, RolloutPayload] = {}
        lost: dict[str, str] = {}
        for ref in refs:
            blob = by_path.get(ref)
            if blob is None:
                lost[ref] = "payload_missing"
                continue
            try:
                found[ref] = unframe(blob)
            except ValueError:
                lost[ref] = "payload_corrupt"
                try:
                    self.fs.mv(self._path(ref), f"{self.root}/quarantine/{ref}")
                except (FileNotFoundError, OSError):
                    pass  # a concurrent reader set it aside first
        return found, lost

    def drop(self, refs: Sequence[str], reason: str) -> int:
        held = set(self._ls("payloads"))
        gone = [r for r in refs if r in held]
        if not gone:
            return 0
        try:
            self.fs.makedirs(f"{self.root}/dropped/{quote(reason, safe='.-_')}", exist_ok=True)
            self.fs.pipe(
                {f"{self.root}/dropped/{quote(reason, safe='.-_')}/{r}": b"" for r in gone}
            )
            self.fs.rm([self._path(r) for r in gone])
        except FileNotFoundError:
            pass  # dropped concurrently: the markers say it once
        except OSError as e:
            raise TransportError(f"rollout store {self.url}: cannot drop: {e}") from e
        return len(gone)

    def refs(self) -> list[str]:
        return self._ls("payloads")

    def counts(self) -> dict[str, Any]:
        dropped = {r: len(self._ls(f"dropped/{r}")) for r in self._ls("dropped")}
        held, corrupt = len(self.refs()), len(self._ls("quarantine"))
        trained = dropped.pop("trained", 0)
        return {
            "put": held + trained + sum(dropped.values()) + corrupt,
            "held": held,
            "trained": trained,
            "corrupt": corrupt,
            "discarded": {k: v for k, v in sorted(dropped.items()) if v},
        }

"""The committed checkpoints under one storage root: listing, the ``latest``
pointer, verification and retention. Any fsspec URL works (``file://`` or a
plain path by default, ``s3://``, ``gs://``, ``memory://``).

Writes are atomic per object: on a local file system a file is written to a
temporary name and renamed; on an object store one PUT is atomic. A step
directory counts only once its manifest is there (written last).
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
import zlib
from typing import Any

import fsspec

from phalanx.checkpoint.base import (
    LATEST,
    MANIFEST,
    METADATA,
    STEP_PREFIX,
    CheckpointInfo,
    CorruptCheckpoint,
    Manifest,
    step_dir,
)

log = logging.getLogger("phalanx.checkpoint")

STAGING = ".staging"
READ_BLOCK = 16 << 20


def sync_dir(path: str) -> None:
    """fsync a local directory, so that a rename in it survives a machine crash."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories; the rename stands
    finally:
        os.close(fd)


def put_atomic(fs: Any, path: str, data: bytes, durable: bool = False) -> None:
    """Write one object atomically: a temporary name and a rename on a local
    disk (fsynced with ``durable``), one PUT on an object store."""
    if not is_local(fs):
        fs.pipe_file(path, data)
        return
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    fs.mv(tmp, path)
    if durable:
        sync_dir(path.rsplit("/", 1)[0])


def is_local(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return protocol in ("file", "local")


class CheckpointStore:
    """Committed checkpoints under ``url``. Safe to use from any process; only
    one job should save under one root."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None):
        if not url:
            raise ValueError("checkpoint url must be a path or fsspec URL: got ''.")
        self.url = url.rstrip("/")
        self.fs, root = fsspec.core.url_to_fs(self.url, **(storage_options or {}))
        self.root = root.rstrip("/")
        self.local = is_local(self.fs)

    # -- paths -----------------------------------------------------------

    def path(self, step: int) -> str:
        return f"{self.root}/{step_dir(step)}"

    def url_of(self, step: int) -> str:
        return f"{self.url}/{step_dir(step)}"

    def staging_path(self, step: int, save_id: str) -> str:
        """Where a save of ``step`` writes before it is committed. On a local
        file system, a private directory renamed into place on commit; on an
        object store (no atomic rename) the step directory itself, which is not
        a checkpoint until its manifest is written."""
        if self.local:
            return f"{self.root}/{STAGING}/{step_dir(step)}-{save_id}"
        return self.path(step)

    # -- reading ---------------------------------------------------------

    def _ls(self, path: str) -> list[str]:
        # Object-store file systems cache listings, and fsspec shares one instance
        # per set of options: without this, a long-lived process would never see a
        # checkpoint another process committed.
        self.fs.invalidate_cache(path)
        return list(self.fs.ls(path, detail=False))

    def steps(self) -> list[int]:
        """Steps with a manifest (committed), oldest first."""
        try:
            names = self._ls(self.root)
        except FileNotFoundError:
            return []
        out = []
        for n in names:
            base = n.rstrip("/").rsplit("/", 1)[-1]
            if base.startswith(STEP_PREFIX) and base[len(STEP_PREFIX) :].isdigit():
                step = int(base[len(STEP_PREFIX) :])
                if self.fs.exists(f"{self.path(step)}/{MANIFEST}"):
                    out.append(step)
        return sorted(out)

    def latest(self) -> int | None:
        """The step ``latest`` names, or the newest committed step if the pointer
        is missing or names a step that is gone."""
        try:
            step = int(json.loads(self.fs.cat_file(f"{self.root}/{LATEST}"))["step"])
            if self.fs.exists(f"{self.path(step)}/{MANIFEST}"):
                return step
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            pass
        steps = self.steps()
        return steps[-1] if steps else None

    def manifest(self, step: int) -> Manifest:
        path = f"{self.path(step)}/{MANIFEST}"
        try:
            return Manifest.from_record(json.loads(self.fs.cat_file(path)))
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{MANIFEST} is missing: it was never committed") from None
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptCheckpoint(f"{MANIFEST} is unreadable ({e})") from e

    def info(self, step: int) -> CheckpointInfo:
        m = self.manifest(step)
        return CheckpointInfo(
            step, self.url_of(step), m.nbytes, m.created_at, m.layout, len(m.tensors)
        )

    def checkpoints(self) -> list[CheckpointInfo]:
        out = []
        for s in self.steps():
            try:
                out.append(self.info(s))
            except CorruptCheckpoint as e:
                log.warning("checkpoint %s: %s", self.url_of(s), e)
        return out

    def verify(
        self, step: int, manifest: Manifest, files: list[str] | None = None, crc: bool = True
    ) -> None:
        """Check ``files`` (default: all) of a committed checkpoint against its
        manifest: present, of the recorded size, and (with ``crc``) every chunk's
        CRC32 right. Raises CorruptCheckpoint saying which file and why."""
        base = self.path(step)
        if METADATA not in manifest.files:
            raise CorruptCheckpoint(f"the manifest lists no {METADATA}")
        for name in sorted(manifest.files) if files is None else files:
            want = manifest.files[name]
            try:
                got = self.fs.size(f"{base}/{name}")
            except FileNotFoundError:
                raise CorruptCheckpoint(f"{name} is missing") from None
            if got != want:
                raise CorruptCheckpoint(
                    f"{name} has {got} bytes, expected {want} (truncated or rewritten)"
                )
            if crc or name == METADATA:
                self._check_chunks(step, base, name, manifest.chunks.get(name, []))

    def _check_chunks(self, step: int, base: str, name: str, chunks: list[dict[str, Any]]) -> None:
        with self.fs.open(f"{base}/{name}", "rb", block_size=READ_BLOCK) as f:
            for c in sorted(chunks, key=lambda c: c["offset"]):
                f.seek(c["offset"])
                left, crc = c["length"], 0
                while left:
                    buf = f.read(min(left, READ_BLOCK))
                    if not buf:
                        raise CorruptCheckpoint(f"{name} ends early")
                    crc, left = zlib.crc32(buf, crc), left - len(buf)
                if crc != c["crc32"]:
                    raise CorruptCheckpoint(
                        f"{name} fails its checksum (chunk {c['key']!r} at byte {c['offset']})"
                    )

    # -- writing ---------------------------------------------------------

    def put_atomic(self, path: str, data: bytes) -> None:
        put_atomic(self.fs, path, data, durable=True)

    def commit(self, staging: str, manifest: Manifest) -> None:
        """Write the manifest (the commit marker), move a local staging directory
        into place, then point ``latest`` at the step."""
        step = manifest.step
        self.put_atomic(f"{staging}/{MANIFEST}", json.dumps(manifest.record()).encode())
        if staging != self.path(step):
            old = None
            if self.fs.exists(self.path(step)):
                # A second save of the same step (a job resumed and saved again):
                # the newer one replaces it. The old one is moved aside first, so
                # that a crash in between leaves one of them in place.
                old = f"{self.root}/{STAGING}/{step_dir(step)}-replaced-{uuid.uuid4().hex[:8]}"
                self.fs.mv(self.path(step), old, recursive=True)
            self.fs.mv(staging, self.path(step), recursive=True)
            sync_dir(self.root)
            if old is not None:
                self.fs.rm(old, recursive=True)
        self.put_atomic(
            f"{self.root}/{LATEST}", json.dumps({"step": step, "at": time.time()}).encode()
        )

    def retain(self, keep_last: int) -> list[int]:
        """Delete all but the newest ``keep_last`` committed checkpoints, and
        partial ones older than the newest commit. Returns the steps deleted.
        A failed deletion is logged and retried at the next call."""
        steps = self.steps()
        drop = steps[:-keep_last] if keep_last > 0 else []
        newest = steps[-1] if steps else -1
        deleted = []
        for s in drop:
            try:
                self.fs.rm(self.path(s), recursive=True)
                deleted.append(s)
            except OSError as e:
                log.warning("could not delete checkpoint %s: %s", self.url_of(s), e)
        for path in self._partial(newest):
            try:
                self.fs.rm(path, recursive=True)
            except OSError as e:
                log.warning("could not delete partial checkpoint %s: %s", path, e)
        return deleted

    def _partial(self, newest: int) -> list[str]:
        """Uncommitted step directories older than ``newest`` (abandoned saves)."""
        out = []
        for parent in (self.root, f"{self.root}/{STAGING}"):
            try:
                names = self._ls(parent)
            except FileNotFoundError:
                continue
            for n in names:
                base = n.rstrip("/").rsplit("/", 1)[-1]
                digits = base[len(STEP_PREFIX) :].split("-", 1)[0]
                if not (base.startswith(STEP_PREFIX) and digits.isdigit()):
                    continue
                step = int(digits)
                committed = parent == self.root and self.fs.exists(f"{n}/{MANIFEST}")
                if not committed and step < newest:
                    out.append(n)
        return out

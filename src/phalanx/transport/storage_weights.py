"""Published policy weights on storage: any fsspec URL (``file://``, ``s3://``, ``memory://``).

Layout under the store's root::

    v<version>-<token>.safetensors   one version's tensors (a fresh name per publish)
    manifest.json                    {"latest": v, "versions": {v: {file, sha256, nbytes, meta}}}

A publish writes the tensors under a name nobody references yet, then
replaces the manifest in one step: a rename of a temporary file on a local
filesystem, a single PUT on an object store (both atomic for readers). A
reader goes through the manifest only, so it never sees a partial version,
and checks the SHA-256 of what it read. Versions beyond the newest ``keep``
leave the manifest first and their files are deleted after: a reader that
raced the collection retries from the new manifest (a fetch of the latest)
or gets a clear error (a fetch of that old version).

One publisher at a time (the policy leader): two concurrent publishers would
race on the manifest, and the older version of the two could be dropped.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Mapping
from typing import Any

import fsspec
import torch
from safetensors.torch import load

from phalanx.comm.base import CommError
from phalanx.tensorfile import save
from phalanx.transport.base import WeightStore


def to_bytes(weights: Mapping[str, torch.Tensor]) -> bytes:
    """safetensors bytes of the tensors on the CPU. safetensors refuses tensors that
    share memory (tied weights): the second and later views of a storage are copied."""
    out, seen = {}, set()
    for k, t in weights.items():
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[k] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return save(out)


def from_bytes(blob: bytes, sha256: str, where: str) -> dict[str, torch.Tensor]:
    got = hashlib.sha256(blob).hexdigest()
    if got != sha256:
        raise CommError(
            f"weights at {where} must match their manifest's checksum: got sha256 {got[:16]}..., "
            f"expected {sha256[:16]}.... The file is damaged; the next publish replaces it."
        )
    return load(blob)


class StorageWeightStore(WeightStore):
    def __init__(
        self, url: str, *, keep: int = 2, storage_options: Mapping[str, Any] | None = None
    ):
        if keep < 1:
            raise ValueError(f"keep must be >= 1: got {keep}.")
        self.fs, root = fsspec.core.url_to_fs(url, **dict(storage_options or {}))
        self.root, self.url, self.keep = root.rstrip("/"), url, keep
        self.fs.makedirs(self.root, exist_ok=True)
        self._local = "file" in (
            self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        )

    def _manifest(self) -> dict[str, Any]:
        try:
            return dict(json.loads(self.fs.cat_file(f"{self.root}/manifest.json")))
        except FileNotFoundError:
            return {"latest": None, "versions": {}}

    def _write_manifest(self, m: dict[str, Any]) -> None:
        data = json.dumps(m, sort_keys=True).encode()
        path = f"{self.root}/manifest.json"
        if self._local:
            tmp = f"{self.root}/.manifest-{uuid.uuid4().hex}.tmp"
            self.fs.pipe_file(tmp, data)
            self.fs.mv(tmp, path)  # rename(2): readers see the old file or the new one
        else:
            self.fs.pipe_file(path, data)  # one PUT replaces an object atomically

    def publish(
        self, version: int, weights: Mapping[str, torch.Tensor], meta: Mapping[str, Any] = {}
    ) -> int:
        blob = to_bytes(weights)
        name = f"v{version:012d}-{uuid.uuid4().hex[:8]}.safetensors"
        self.fs.pipe_file(f"{self.root}/{name}", blob)
        m = self._manifest()
        vs: dict[str, Any] = m["versions"]
        vs[str(version)] = {
            "file": name,
            "sha256": hashlib.sha256(blob).hexdigest(),
            "nbytes": len(blob),
            "meta": dict(meta),
            "published_at": time.time(),
        }
        order = sorted(vs, key=int)
        dropped = [vs.pop(v)["file"] for v in order[: -self.keep]]
        m["latest"] = max(int(v) for v in vs)
        self._write_manifest(m)
        self._collect(dropped, {e["file"] for e in vs.values()})
        return len(blob)

    def _collect(self, dropped: list[str], kept: set[str]) -> None:
        # Also files no manifest ever referenced: a publisher that died before its commit.
        oldest = min(int(f[1:13]) for f in kept)
        for path in self.fs.ls(self.root, detail=False):
            f = path.rsplit("/", 1)[-1]
            if (
                f.endswith(".safetensors")
                and f not in kept
                and (f in dropped or int(f[1:13]) < oldest)
            ):
                try:
                    self.fs.rm_file(f"{self.root}/{f}")
                except FileNotFoundError:
                    pass

    def latest(self) -> tuple[int, dict[str, Any]] | None:
        m = self._manifest()
        if m["latest"] is None:
            return None
        return int(m["latest"]), dict(m["versions"][str(m["latest"])]["meta"])

    def versions(self) -> list[int]:
        return sorted(int(v) for v in self._manifest()["versions"])

    def fetch(self, version: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        for _ in range(5):
            m = self._manifest()
            v = m["latest"] if version is None else version
            if v is None:
                raise CommError(f"no weights published yet in {self.url}.")
            entry = m["versions"].get(str(v))
            if entry is None:
                raise CommError(
                    f"weights version {v} must be in the store at {self.url} to be fetched: got "
                    f"versions {sorted(int(x) for x in m['versions'])}. Older versions are "
                    f"collected (keep={self.keep}); fetch the latest."
                )
            try:
                blob = self.fs.cat_file(f"{self.root}/{entry['file']}")
            except FileNotFoundError:
                continue  # collected under us by a newer publish: read the manifest again
            return int(v), from_bytes(blob, entry["sha256"], f"{self.url}/{entry['file']}")
        raise CommError(f"weights version {version} at {self.url} kept vanishing while read.")

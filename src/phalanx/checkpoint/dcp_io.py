"""torch.distributed.checkpoint storage for any fsspec URL, with no pickle.

DCP plans a save or a load from global shapes and chunk offsets, which is
what lets any layout load any other; where the bytes go is up to a
``StorageWriter``/``StorageReader``. torch's own file and fsspec ones pickle
the metadata (and its default planner pickles non-tensor values), so a
checkpoint read from shared storage could run code. These write:

- each rank's chunks as raw bytes, back to back, in ``data-r<rank>.bin``, with
  the CRC32 of every chunk recorded as it is written;
- the metadata as JSON (:func:`metadata_to_json`), by the coordinator, after
  every rank's data is written.

Only tensors may be saved this way; :mod:`phalanx.checkpoint.checkpointer`
keeps everything else in the manifest's JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from phalanx.checkpoint.base import METADATA, CheckpointError, CorruptCheckpoint
from phalanx.comm.transfer import DTYPES


def dtype_name(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise CorruptCheckpoint(
            f"tensor dtype must be one of {sorted(DTYPES)}: got {name!r}"
        ) from None


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a CPU tensor, in row-major order (a copy only if not contiguous)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return memoryview(flat.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]


def tensor_from(buf: bytearray, dtype: str, shape: list[int]) -> torch.Tensor:
    """A tensor over ``buf`` (no copy)."""
    d = dtype_of(dtype)
    if not shape or 0 not in shape:
        if d == torch.bool:
            return torch.frombuffer(buf, dtype=torch.uint8).to(torch.bool).reshape(shape)
        return torch.frombuffer(buf, dtype=d).reshape(shape)
    return torch.empty(shape, dtype=d)


# -- metadata as JSON ------------------------------------------------------


def _index(i: MetadataIndex) -> dict[str, Any]:
    return {"fqn": i.fqn, "offset": None if i.offset is None else list(i.offset)}


def metadata_to_json(md: Metadata) -> bytes:
    sd: dict[str, Any] = {}
    for fqn, m in md.state_dict_metadata.items():
        if isinstance(m, TensorStorageMetadata):
            sd[fqn] = {
                "dtype": dtype_name(m.properties.dtype),
                "requires_grad": m.properties.requires_grad,
                "size": list(m.size),
                "chunks": [[list(c.offsets), list(c.sizes)] for c in m.chunks],
            }
        else:
            raise CheckpointError(
                f"checkpoint state must hold only tensors: {fqn!r} is not one. "
                f"Put plain values in the state tree (they go to the manifest as JSON)."
            )
    storage = [[_index(k), v] for k, v in (md.storage_data or {}).items()]
    planner = md.planner_data
    if isinstance(planner, dict):
        planner = {k: list(v) for k, v in planner.items()}
    doc = {"version": md.version, "state_dict": sd, "storage": storage, "planner": planner}
    return json.dumps(doc, separators=(",", ":")).encode()


def metadata_from_json(raw: bytes) -> Metadata:
    try:
        doc = json.loads(raw)
        sd: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {
            fqn: TensorStorageMetadata(
                properties=TensorProperties(
                    dtype=dtype_of(m["dtype"]), requires_grad=bool(m["requires_grad"])
                ),
                size=torch.Size(m["size"]),
                chunks=[ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in m["chunks"]],
            )
            for fqn, m in doc["state_dict"].items()
        }
        storage = {MetadataIndex(k["fqn"], k["offset"]): v for k, v in doc["storage"]}
        planner = doc["planner"]
        if isinstance(planner, dict):
            planner = {k: tuple(v) for k, v in planner.items()}
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpoint(f"{METADATA} is not valid checkpoint metadata ({e})") from e
    return Metadata(sd, planner_data=planner, storage_data=storage, version=doc.get("version"))


# -- writer ----------------------------------------------------------------


class JsonStorageWriter(StorageWriter):
    """Writes one data file per rank into ``path`` (an fsspec path on ``fs``).

    After ``dcp.save`` returns, the coordinator's :attr:`chunks` lists every
    chunk written by every rank: ``file -> [{key, offset, length, crc32}]``."""

    def __init__(self, fs: Any, path: str, sync_files: bool = True):
        self.fs, self.path = fs, path.rstrip("/")
        # fsync data files on a local file system before the commit, so that a
        # committed checkpoint survives a machine crash, not only a killed process.
        self.sync_files = sync_files and hasattr(fs, "local_file")
        self.is_coordinator = False
        self.chunks: dict[str, list[dict[str, Any]]] = {}
        self.tensors: dict[str, TensorStorageMetadata] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        self.chunks, self.tensors = {}, {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [dataclasses.replace(p, storage_data=f"data-r{i}.bin") for i, p in enumerate(plans)]

    def write_data(
        self, plan: SavePlan, planner: SavePlanner
    ) -> torch.futures.Future[list[WriteResult]]:
        name = plan.storage_data
        results: list[WriteResult] = []
        offset = 0
        if not plan.items:  # everything this rank holds is saved by another (replicas)
            fut: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
            fut.set_result(results)
            return fut
        with self.fs.open(f"{self.path}/{name}", "wb") as f:
            for item in plan.items:
                if item.type == WriteItemType.BYTE_IO:
                    raise CheckpointError(
                        f"checkpoint state must hold only tensors: {item.index.fqn!r} is not "
                        f"one. Put plain values in the state tree, not the tensor dict."
                    )
                t = planner.resolve_data(item)
                assert isinstance(t, torch.Tensor)
                t = t.detach().cpu()
                buf = tensor_bytes(t)
                f.write(buf)
                info = {
                    "file": name,
                    "offset": offset,
                    "length": buf.nbytes,
                    "crc32": zlib.crc32(buf),
                    "dtype": dtype_name(t.dtype),
                    "shape": list(t.shape),
                }
                offset += buf.nbytes
                results.append(WriteResult(item.index, buf.nbytes, info))
            if self.sync_files:
                f.flush()
                os.fsync(f.fileno())
        done: torch.futures.Future[list[WriteResult]] = torch.futures.Future()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage: dict[MetadataIndex, Any] = {}
        chunks: dict[str, list[dict[str, Any]]] = {}
        for rank_results in results:
            for r in rank_results:
                storage[r.index] = r.storage_data
                d = r.storage_data
                chunks.setdefault(d["file"], []).append(
                    {
                        "key": r.index.fqn,
                        "offset": d["offset"],
                        "length": d["length"],
                        "crc32": d["crc32"],
                    }
                )
        metadata.storage_data = storage
        self.fs.pipe_file(f"{self.path}/{METADATA}", metadata_to_json(metadata))
        self.chunks = chunks
        self.tensors = {
            k: m
            for k, m in metadata.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata)
        }

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def storage_meta(self) -> None:
        return None


# -- reader ----------------------------------------------------------------


class JsonStorageReader(StorageReader):
    """Reads what :class:`JsonStorageWriter` wrote; each chunk a rank needs is
    read with one ranged read, so a rank reads only the bytes it loads."""

    def __init__(self, fs: Any, path: str):
        self.fs, self.path = fs, path.rstrip("/")
        self.storage_data: dict[MetadataIndex, Any] = {}

    def reset(self, checkpoint_id: Any = None) -> None:
        self.storage_data = {}

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return metadata_from_json(self.fs.cat_file(f"{self.path}/{METADATA}"))

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> torch.futures.Future[None]:
        per_file: dict[str, list[Any]] = {}
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                raise CheckpointError(
                    f"checkpoint key {req.storage_index.fqn!r} is not a tensor; phalanx "
                    f"checkpoints hold only tensors in DCP (plain values are in the manifest)."
                )
            per_file.setdefault(self.storage_data[req.storage_index]["file"], []).append(req)
        for name, reqs in per_file.items():
            reqs.sort(key=lambda r: self.storage_data[r.storage_index]["offset"])
            with self.fs.open(f"{self.path}/{name}", "rb") as f:
                for req in reqs:
                    d = self.storage_data[req.storage_index]
                    f.seek(d["offset"])
                    buf = bytearray(d["length"])
                    got = f.readinto(buf) if d["length"] else 0
                    if got != d["length"]:
                        raise CorruptCheckpoint(
                            f"{name} is truncated: chunk of {req.storage_index.fqn!r} needs "
                            f"{d['length']} bytes at {d['offset']}, got {got}"
                        )
                    # Checked as read: a chunk that fails fails the whole load on
                    # every rank before any caller's tensor is written.
                    if "crc32" in d and zlib.crc32(buf) != d["crc32"]:
                        raise CorruptCheckpoint(
                            f"{name} fails its checksum (chunk {req.storage_index.fqn!r} at "
                            f"byte {d['offset']})"
                        )
                    src = tensor_from(buf, d["dtype"], d["shape"])
                    for dim, (start, length) in enumerate(
                        zip(req.storage_offsets, req.lengths, strict=True)
                    ):
                        src = src.narrow(dim, start, length)
                    target = planner.resolve_tensor(req).detach()
                    if target.shape != src.shape:
                        raise CheckpointError(
                            f"chunk {req.storage_index.fqn!r} has shape {tuple(src.shape)}, "
                            f"expected {tuple(target.shape)}"
                        )
                    target.copy_(src)
                    planner.commit_tensor(req, target)
        fut: torch.futures.Future[None] = torch.futures.Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

"""Universal checkpoints: the vocabulary shared by the writer, the store and
the loader.

A checkpoint of step ``s`` under a storage root ``ROOT`` (any fsspec URL) is
the directory ``ROOT/step-<s, 9 digits>/`` holding:

- ``data-r<rank>.bin``: each saving rank's tensor chunks, raw bytes back to back;
- ``.metadata``: torch.distributed.checkpoint's metadata (global shapes,
  chunk offsets, where each chunk lies), as JSON, never pickle;
- ``phalanx.json`` (:class:`Manifest`): the commit marker, written last. It
  lists every file with its size and the CRC32 of every chunk, the global
  shape and dtype of every tensor, the saving layout, and the state tree's
  non-tensor part (step, data cursor, RNG, config, optimizer param_groups).

``ROOT/latest`` names the newest committed step; it is replaced atomically
after the manifest is written. A directory without a manifest is partial and
never loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FORMAT = "phalanx-ckpt-1"
MANIFEST = "phalanx.json"
METADATA = ".metadata"
LATEST = "latest"
STEP_PREFIX = "step-"


def step_dir(step: int) -> str:
    return f"{STEP_PREFIX}{step:09d}"


class CheckpointError(RuntimeError):
    """No checkpoint could be saved or loaded; the message says why and what to do."""


class CorruptCheckpoint(CheckpointError):
    """A committed checkpoint's files do not match its manifest (missing,
    truncated, wrong checksum) or its manifest is unreadable."""


class NoUsableCheckpoint(CheckpointError):
    """Checkpoints exist under the root but none could be loaded. Starting the
    replica again cannot help: the launchers stop the job with this one line."""


class IncompatibleCheckpoint(CheckpointError):
    """A checkpoint whose tensors do not fit the state being loaded (another
    model, or another optimizer)."""


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: str

    def record(self) -> dict[str, Any]:
        return {"shape": list(self.shape), "dtype": self.dtype}


@dataclass
class Manifest:
    """The commit marker of one checkpoint (``phalanx.json``)."""

    step: int
    save_id: str
    created_at: float
    world_size: int
    """Ranks that wrote the checkpoint."""
    layout: dict[str, Any]
    """How the saving job was laid out, e.g. ``{"dp": 4, "tp": 2}`` (informational:
    any layout loads any other)."""
    files: dict[str, int]
    """File name -> size in bytes."""
    chunks: dict[str, list[dict[str, Any]]]
    """File name -> its chunks: ``{"key", "offset", "length", "crc32"}``."""
    tensors: dict[str, TensorInfo]
    skeleton: Any
    """The state tree with each tensor replaced by ``{"__t__": key}``."""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(self.files.values())

    def record(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "step": self.step,
            "save_id": self.save_id,
            "created_at": self.created_at,
            "world_size": self.world_size,
            "layout": self.layout,
            "files": self.files,
            "chunks": self.chunks,
            "tensors": {k: v.record() for k, v in self.tensors.items()},
            "skeleton": self.skeleton,
            "extra": self.extra,
        }

    @staticmethod
    def from_record(d: dict[str, Any]) -> Manifest:
        if d.get("format") != FORMAT:
            raise CorruptCheckpoint(
                f"manifest format must be {FORMAT!r}: got {d.get('format')!r}. "
                f"It was not written by this version of phalanx."
            )
        return Manifest(
            step=int(d["step"]),
            save_id=str(d["save_id"]),
            created_at=float(d["created_at"]),
            world_size=int(d["world_size"]),
            layout=dict(d["layout"]),
            files={str(k): int(v) for k, v in d["files"].items()},
            chunks={str(k): list(v) for k, v in d["chunks"].items()},
            tensors={
                k: TensorInfo(tuple(int(x) for x in v["shape"]), str(v["dtype"]))
                for k, v in d["tensors"].items()
            },
            skeleton=d["skeleton"],
            extra=dict(d.get("extra", {})),
        )


@dataclass(frozen=True)
class CheckpointInfo:
    """One committed checkpoint, as :meth:`CheckpointStore.list` sees it."""

    step: int
    url: str
    nbytes: int
    created_at: float
    layout: dict[str, Any]
    tensors: int


@dataclass
class LoadResult:
    """What :meth:`Checkpointer.load` loaded, and what it skipped on the way."""

    step: int
    url: str
    manifest: Manifest
    state: Any
    """The saved state tree: the caller's template tensors, filled in place, and
    freshly allocated full tensors for keys the template did not have."""
    skipped: list[tuple[int, str]] = field(default_factory=list)
    """(step, reason) of each newer checkpoint that could not be used."""
    seconds: float = 0.0

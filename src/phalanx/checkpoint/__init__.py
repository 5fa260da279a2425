"""Universal checkpoints (torch.distributed.checkpoint, any fsspec URL) that
reshard on load. See :mod:`phalanx.checkpoint.base` for the layout."""

from phalanx.checkpoint.base import (
    CheckpointError,
    CheckpointInfo,
    CorruptCheckpoint,
    IncompatibleCheckpoint,
    LoadResult,
    Manifest,
    NoUsableCheckpoint,
)
from phalanx.checkpoint.checkpointer import Checkpointer
from phalanx.checkpoint.store import CheckpointStore

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointStore",
    "Checkpointer",
    "CorruptCheckpoint",
    "IncompatibleCheckpoint",
    "LoadResult",
    "Manifest",
    "NoUsableCheckpoint",
]

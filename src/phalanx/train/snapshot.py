"""A replica's own last committed state in one local file: what a single
policy replica resumes from after it was killed, when no peer can heal it.

The file is safetensors: the state tree's tensors, plus its JSON skeleton
(:func:`phalanx.comm.transfer.flatten`) in the metadata, so nothing is
pickled. It is written to a temporary name and renamed, so a kill
during a save leaves the previous snapshot whole. Universal, resharding
checkpoints to storage are ``phalanx.checkpoint``'s job; this is the
minimal local form.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load as st_load

from phalanx.comm.transfer import flatten, unflatten
from phalanx.tensorfile import save as st_save

FORMAT = "phalanx-state-1"


def pack_state(tree: Any) -> bytes:
    """``tree`` as the bytes of a state file (for object stores)."""
    skeleton, tensors = flatten(tree)
    # clone: safetensors refuses tensors that share storage (tied embeddings).
    named = {f"t{i}": t.detach().cpu().contiguous().clone() for i, t in enumerate(tensors)}
    return st_save(named, metadata={"format": FORMAT, "skeleton": json.dumps(skeleton)})


def unpack_state(raw: bytes, what: str) -> Any:
    """Read :func:`pack_state` bytes. ValueError (saying why) if they are not a state."""
    try:
        tensors = st_load(raw)
        header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
        meta = header.get("__metadata__") or {}
    except (SafetensorError, ValueError) as e:
        raise ValueError(f"state {what} is unreadable ({e}); delete it to start over.") from e
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"state {what} must be a phalanx state ({FORMAT}): got format "
            f"{meta.get('format')!r}. Delete it to start from scratch."
        )
    return unflatten(json.loads(meta["skeleton"]), [tensors[f"t{i}"] for i in range(len(tensors))])


def save_state(path: str | Path, tree: Any) -> int:
    """Write ``tree`` atomically to ``path``. Returns the bytes written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(pack_state(tree))
    # No fsync: the rename is atomic against a killed process (the page cache
    # outlives it), which is the failure this file is for; surviving a power
    # loss is the job of checkpoints to storage.
    tmp.replace(path)
    return path.stat().st_size


def load_state(path: str | Path) -> Any:
    """Read a :func:`save_state` file. ValueError (saying why) if it is not one."""
    try:
        raw = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"state file {path} is unreadable ({e}); delete it to start over.") from e
    return unpack_state(raw, f"file {path}")

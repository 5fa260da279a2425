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

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from phalanx.comm.transfer import flatten, unflatten

FORMAT = "phalanx-state-1"


def save_state(path: str | Path, tree: Any) -> int:
    """Write ``tree`` atomically to ``path``. Returns the bytes written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    skeleton, tensors = flatten(tree)
    # clone: safetensors refuses tensors that share storage (tied embeddings).
    named = {f"t{i}": t.detach().cpu().contiguous().clone() for i, t in enumerate(tensors)}
    tmp = path.with_name(path.name + ".tmp")
    save_file(named, str(tmp), metadata={"format": FORMAT, "skeleton": json.dumps(skeleton)})
    # No fsync: the rename is atomic against a killed process (the page cache
    # outlives it), which is the failure this file is for; surviving a power
    # loss is the job of checkpoints to storage.
    tmp.replace(path)
    return path.stat().st_size


def load_state(path: str | Path) -> Any:
    """Read a :func:`save_state` file. ValueError (saying why) if it is not one."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = [f.get_tensor(f"t{i}") for i in range(len(list(f.keys())))]
    except (OSError, SafetensorError) as e:
        raise ValueError(f"state file {path} is unreadable ({e}); delete it to start over.") from e
    if meta.get("format") != FORMAT:
        raise ValueError(
            f"state file {path} must be a phalanx state ({FORMAT}): got format "
            f"{meta.get('format')!r}. Delete it to start from scratch."
        )
    return unflatten(json.loads(meta["skeleton"]), tensors)

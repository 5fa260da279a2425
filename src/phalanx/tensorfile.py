"""safetensors that are equal when the states are equal: byte for byte.

``safetensors`` writes the tensors in sorted order but the metadata (``__metadata__``)
from a hash map, whose order changes from one process to the next: two replicas
holding identical weights wrote different bytes, and so different checksums. Every
safetensors file or object phalanx writes goes through :func:`save`, which puts the
metadata keys in sorted order (the header keeps its length, so nothing else moves).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save as st_save
from safetensors.torch import save_file as st_save_file


def _sorted_header(head: bytes) -> bytes | None:
    """The header (the bytes after the length) with sorted metadata keys, padded to the
    same length; None if it cannot keep that length (then the bytes stay as they are)."""
    header = json.loads(head)
    if len(header.get("__metadata__") or {}) < 2:
        return None
    header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    return text.ljust(len(head), b" ") if len(text) <= len(head) else None


def save(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """``safetensors.torch.save`` with its metadata keys in sorted order."""
    raw = st_save(tensors, metadata=metadata)
    n = int.from_bytes(raw[:8], "little")
    head = _sorted_header(raw[8 : 8 + n])
    return raw if head is None else raw[:8] + head + raw[8 + n :]


def save_file(
    tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None
) -> None:
    """:func:`save` to ``path``, atomically (a temporary name, then a rename), without
    holding the file's bytes in memory: the header is put in order in place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    st_save_file(tensors, str(tmp), metadata=metadata)
    with tmp.open("r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        head = _sorted_header(f.read(n))
        if head is not None:
            f.seek(8)
            f.write(head)
    os.replace(tmp, path)

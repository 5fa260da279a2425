"""Send a state tree (nested dicts/lists of tensors and JSON values) between
replicas as raw buffers: no pickle ever touches data from the network.

Wire format, over any :class:`Communicator` send/recv pair:

1. an int64 header ``[json_len, buffer_len]``;
2. the JSON skeleton (uint8), where each tensor is a placeholder
   ``{"t": index, "dtype": "float32", "shape": [...], "offset": bytes}``;
3. one uint8 buffer holding every tensor's bytes back to back (each offset
   aligned to 64 bytes), sent in chunks.

Dict keys keep their type (optimizer state is keyed by int), and tuples
come back as tuples.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from phalanx.comm.base import Communicator

ALIGN = 64
CHUNK_BYTES = 64 << 20
_DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def flatten(tree: Any) -> tuple[Any, list[torch.Tensor]]:
    """Split a state tree into a JSON-able skeleton and its tensors."""
    tensors: list[torch.Tensor] = []

    def walk(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x.detach())
            return {"__t__": len(tensors) - 1}
        if isinstance(x, dict):
            return {"__d__": [[walk_key(k), walk(v)] for k, v in x.items()]}
        if isinstance(x, tuple):
            return {"__tuple__": [walk(v) for v in x]}
        if isinstance(x, list):
            return [walk(v) for v in x]
        if x is None or isinstance(x, bool | int | float | str):
            return x
        if hasattr(x, "tolist"):  # numpy arrays and scalars (RNG states)
            return {"__np__": x.tolist(), "dtype": str(x.dtype)}
        raise TypeError(
            f"state must hold only tensors, dicts, lists, tuples and JSON scalars: got {type(x)}"
        )

    def walk_key(k: Any) -> Any:
        if isinstance(k, bool | int | str):
            return k
        raise TypeError(f"state dict keys must be str or int: got {type(k)}")

    return walk(tree), tensors


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    def walk(x: Any) -> Any:
        if isinstance(x, dict):
            if "__t__" in x:
                return tensors[x["__t__"]]
            if "__d__" in x:
                return {k: walk(v) for k, v in x["__d__"]}
            if "__tuple__" in x:
                return tuple(walk(v) for v in x["__tuple__"])
            if "__np__" in x:
                import numpy as np

                return np.asarray(x["__np__"], dtype=x["dtype"])
            raise ValueError(f"malformed state skeleton node: {sorted(x)}")
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return walk(skeleton)


def pack(tree: Any) -> tuple[bytes, torch.Tensor]:
    """Serialise a state tree into (JSON header bytes, one uint8 buffer)."""
    skeleton, tensors = flatten(tree)
    metas, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        metas.append(
            {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": offset}
        )
        offset += (nbytes + ALIGN - 1) // ALIGN * ALIGN
    buf = torch.empty(offset, dtype=torch.uint8)
    for t, m in zip(tensors, metas, strict=True):
        src = (
            t.contiguous().reshape(-1).view(torch.uint8)
            if t.numel()
            else t.reshape(0).to(torch.uint8)
        )
        buf[m["offset"] : m["offset"] + src.numel()].copy_(src.cpu())
    header = json.dumps({"skeleton": skeleton, "tensors": metas}, separators=(",", ":")).encode()
    return header, buf


def unpack(header: bytes, buf: torch.Tensor) -> Any:
    meta = json.loads(header)
    tensors = []
    for m in meta["tensors"]:
        dtype = _DTYPES.get(m["dtype"])
        if dtype is None:
            raise ValueError(
                f"state tensor dtype must be one of {sorted(_DTYPES)}: got {m['dtype']}"
            )
        shape = m["shape"]
        n = 1
        for s in shape:
            n *= s
        nbytes = n * torch.empty(0, dtype=dtype).element_size()
        if m["offset"] + nbytes > buf.numel():
            raise ValueError("state buffer is shorter than its header says: transfer truncated")
        raw = buf[m["offset"] : m["offset"] + nbytes]
        # Views into ``buf`` (freshly allocated and owned here): no second copy.
        tensors.append(raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype))
    return unflatten(meta["skeleton"], tensors)


def send_state(comm: Communicator, tree: Any, dst: int, tag: int = 0) -> int:
    """Send a state tree to ``dst``; returns the bytes sent. Matched by :func:`recv_state`."""
    header, buf = pack(tree)
    comm.send(torch.tensor([len(header), buf.numel()], dtype=torch.int64), dst, tag)
    comm.send(torch.frombuffer(bytearray(header), dtype=torch.uint8), dst, tag)
    for i in range(0, buf.numel(), CHUNK_BYTES):
        comm.send(buf[i : i + CHUNK_BYTES], dst, tag)
    return len(header) + buf.numel()


def recv_state(comm: Communicator, src: int, tag: int = 0) -> Any:
    sizes = torch.empty(2, dtype=torch.int64)
    comm.recv(sizes, src, tag)
    hlen, blen = int(sizes[0]), int(sizes[1])
    header = torch.empty(hlen, dtype=torch.uint8)
    comm.recv(header, src, tag)
    buf = torch.empty(blen, dtype=torch.uint8)
    for i in range(0, blen, CHUNK_BYTES):
        comm.recv(buf[i : i + CHUNK_BYTES], src, tag)
    return unpack(header.numpy().tobytes(), buf)

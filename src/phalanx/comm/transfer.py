"""Send a state tree (nested dicts/lists of tensors and JSON values) between
replicas as raw buffers: no pickle ever touches data from the network.

Wire format, over any :class:`Communicator` send/recv pair:

1. a preamble of ``PREAMBLE_BYTES``: int64 ``[json_len, buffer_len]``, then the
   start of the JSON skeleton (uint8), where each tensor is a placeholder
   ``{"t": index, "dtype": "float32", "shape": [...], "offset": bytes}``;
2. the rest of the JSON, only when it did not fit in the preamble (a message
   less saves a round trip on the common, small header);
3. the bytes of one uint8 buffer holding every tensor back to back (each
   offset aligned to 64 bytes), in segments that both sides derive from the
   header (:func:`segments`): a tensor of at least ``DIRECT_BYTES`` is its own
   segment and is sent straight from its storage, with no packing copy; runs
   of smaller tensors are packed into one segment. Segments over
   ``CHUNK_BYTES`` go in chunks. The receiver gets the same buffer as
   :func:`pack` would build (alignment padding aside) and unpacks it.

Dict keys keep their type (optimizer state is keyed by int), and tuples
come back as tuples.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch

from phalanx.comm.base import Communicator

ALIGN = 64
PREAMBLE_BYTES = 16 << 10
CHUNK_BYTES = 64 << 20
DIRECT_BYTES = 1 << 20
"""Tensors at least this big are sent from their own storage (no copy); smaller
ones are packed together so that a state with many tiny tensors costs few sends."""
DTYPES = {
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


_PLAIN = (int, float, str, bool, type(None))
"""Exact types a sequence may hold to go into the skeleton as it is (no walk)."""


def flatten(tree: Any, keyed: bool = False) -> tuple[Any, Any]:
    """Split a state tree into a JSON-able skeleton and its tensors.

    The tensors come back as a list (placeholders hold their index) or, with
    ``keyed``, as a dict named by each tensor's path in the tree
    (``"optimizer/state/0/exp_avg"``; a ``/`` inside a key is written ``%2F``),
    which stays the same across layouts: what checkpoints need."""
    tensors: list[torch.Tensor] = []
    named: dict[str, torch.Tensor] = {}

    def walk(x: Any, path: tuple[str, ...]) -> Any:
        if isinstance(x, torch.Tensor):
            if keyed:
                name = "/".join(path)
                named[name] = x.detach()
                return {"__t__": name}
            tensors.append(x.detach())
            return {"__t__": len(tensors) - 1}
        if isinstance(x, dict):
            return {"__d__": [[walk_key(k), walk(v, (*path, seg(k)))] for k, v in x.items()]}
        if isinstance(x, tuple | list):
            if all(type(v) in _PLAIN for v in x):  # e.g. an RNG state: 625 ints
                items = list(x)
            else:
                items = [walk(v, (*path, str(i))) for i, v in enumerate(x)]
            return {"__tuple__": items} if isinstance(x, tuple) else items
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

    def seg(k: Any) -> str:
        return str(k).replace("%", "%25").replace("/", "%2F")

    skeleton = walk(tree, ())
    return skeleton, (named if keyed else tensors)


def unflatten(skeleton: Any, tensors: Any) -> Any:
    """Rebuild a tree from :func:`flatten`'s skeleton and tensors (list or dict)."""

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


def _layout(tree: Any) -> tuple[bytes, list[torch.Tensor], list[dict[str, Any]], int]:
    """(JSON header, the tree's tensors, their metas, buffer length) of a state tree."""
    skeleton, tensors = flatten(tree)
    metas, offset = [], 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        metas.append(
            {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "offset": offset}
        )
        offset += aligned(nbytes)
    header = json.dumps({"skeleton": skeleton, "tensors": metas}, separators=(",", ":")).encode()
    return header, tensors, metas, offset


def buffer_bytes(tree: Any) -> int:
    """Length of the buffer :func:`recv_state` needs for ``tree`` (alignment included)."""
    _, tensors = flatten(tree)
    return sum(aligned(t.numel() * t.element_size()) for t in tensors)


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the buffer's tensor alignment (``ALIGN``)."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


def faulted_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 buffer whose pages are all mapped already. A receive into new memory
    pays a page fault per 4 KiB page, about as much as the transfer itself on a
    fast wire; a joiner fills this while it waits for its quorum, and hands it to
    :func:`recv_state` as ``scratch``."""
    return torch.empty(nbytes, dtype=torch.uint8).fill_(0)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of ``t`` (a copy only if it is not contiguous)."""
    if not t.numel():
        return t.reshape(0).to(torch.uint8)
    return t.contiguous().reshape(-1).view(torch.uint8)


def _copy_into(
    buf: torch.Tensor, base: int, tensors: list[torch.Tensor], metas: list[dict[str, Any]]
) -> None:
    """Copy ``tensors`` into ``buf``, which holds the packed bytes from offset ``base``."""
    for t, m in zip(tensors, metas, strict=True):
        src = _as_bytes(t)
        start = m["offset"] - base
        buf[start : start + src.numel()].copy_(src)


def pack(tree: Any) -> tuple[bytes, torch.Tensor]:
    """Serialise a state tree into (JSON header bytes, one uint8 buffer)."""
    header, tensors, metas, length = _layout(tree)
    buf = torch.empty(length, dtype=torch.uint8)
    _copy_into(buf, 0, tensors, metas)
    return header, buf


def _dtype(name: str) -> torch.dtype:
    dtype = DTYPES.get(name)
    if dtype is None:
        raise ValueError(f"state tensor dtype must be one of {sorted(DTYPES)}: got {name}")
    return dtype


def _nbytes(m: dict[str, Any]) -> int:
    n = 1
    for s in m["shape"]:
        n *= s
    return n * torch.empty(0, dtype=_dtype(m["dtype"])).element_size()


def segments(metas: list[dict[str, Any]]) -> list[tuple[int, int, list[int]]]:
    """Split the buffer described by ``metas`` into the byte ranges sent one by one:
    ``(start, end, tensor indices)``. A tensor of at least ``DIRECT_BYTES`` is a
    range of its own; consecutive smaller ones share one (empty ranges are left
    out). Sender and receiver both derive the ranges from the header, so they
    always agree."""
    out: list[tuple[int, int, list[int]]] = []
    run: list[int] = []

    def close_run() -> None:
        if run:
            start = metas[run[0]]["offset"]
            end = metas[run[-1]]["offset"] + _nbytes(metas[run[-1]])
            if end > start:
                out.append((start, end, list(run)))
            run.clear()

    for i, m in enumerate(metas):
        n = _nbytes(m)
        if n >= DIRECT_BYTES:
            close_run()
            out.append((m["offset"], m["offset"] + n, [i]))
        else:
            run.append(i)
    close_run()
    return out


def unpack(header: bytes, buf: torch.Tensor) -> Any:
    return _unpack(json.loads(header), buf)


def _unpack(meta: dict[str, Any], buf: torch.Tensor) -> Any:
    tensors = []
    for m in meta["tensors"]:
        dtype = _dtype(m["dtype"])
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
    """Send a state tree to ``dst``; returns the bytes sent. Matched by :func:`recv_state`.

    The tree's tensors must not change until this returns: large ones are sent
    from their own storage."""
    header, tensors, metas, length = _layout(tree)
    segs = segments(metas)  # refuses an unsupported dtype before anything is sent
    dev = comm.device
    preamble = torch.zeros(PREAMBLE_BYTES, dtype=torch.uint8)
    preamble[:16].view(torch.int64).copy_(torch.tensor([len(header), length]))
    inline = header[: PREAMBLE_BYTES - 16]
    preamble[16 : 16 + len(inline)] = torch.frombuffer(bytearray(inline), dtype=torch.uint8)
    out = [preamble.to(dev)]
    if len(header) > len(inline):
        rest = torch.frombuffer(bytearray(header[len(inline) :]), dtype=torch.uint8)
        out.append(rest.to(dev))
    for start, end, idx in segs:
        t = tensors[idx[0]]
        if len(idx) == 1 and t.device == dev:
            seg = _as_bytes(t)  # no copy for a contiguous tensor already on the wire's device
        else:
            seg = torch.empty(end - start, dtype=torch.uint8, device=dev)
            _copy_into(seg, start, [tensors[i] for i in idx], [metas[i] for i in idx])
        out += [seg[i : i + CHUNK_BYTES] for i in range(0, seg.numel(), CHUNK_BYTES)]
    comm.send_many(out, dst, tag)
    return len(header) + length


def _receive_buffer(
    scratch: torch.Tensor | None, nbytes: int, device: torch.device
) -> torch.Tensor:
    """The start of ``scratch`` if it is a long enough flat uint8 tensor on ``device``,
    else new memory there."""
    if (
        scratch is not None
        and scratch.dtype == torch.uint8
        and scratch.dim() == 1
        and scratch.is_contiguous()
        and scratch.device == device
        and scratch.numel() >= nbytes
    ):
        return scratch[:nbytes]
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def recv_state(
    comm: Communicator,
    src: int,
    tag: int = 0,
    scratch: torch.Tensor | None = None,
    times: dict[str, float] | None = None,
) -> Any:
    """Receive a state tree sent by :func:`send_state`. Its tensors are views into
    one buffer: the start of ``scratch`` (a flat uint8 tensor, e.g. from
    :func:`faulted_buffer`) when it is long enough, else new memory. Every buffer
    lives on the communicator's device, and so do the received tensors.
    ``times``, if given, gets ``started`` (the sender's first bytes arrived) and
    ``received`` (the last), as ``time.perf_counter()`` values."""
    dev = comm.device
    preamble = torch.empty(PREAMBLE_BYTES, dtype=torch.uint8, device=dev)
    comm.recv(preamble, src, tag)
    if times is not None:
        times["started"] = time.perf_counter()
    preamble = preamble.cpu()
    hlen, blen = (int(x) for x in preamble[:16].view(torch.int64))
    head = preamble[16 : 16 + hlen].numpy().tobytes()
    if hlen > len(head):
        rest = torch.empty(hlen - len(head), dtype=torch.uint8, device=dev)
        comm.recv(rest, src, tag)
        head += rest.cpu().numpy().tobytes()
    buf = _receive_buffer(scratch, blen, dev)
    meta = json.loads(head)
    parts = []
    for start, end, _ in segments(meta["tensors"]):
        if end > blen:
            raise ValueError("state buffer is shorter than its header says: transfer truncated")
        parts += [buf[i : min(i + CHUNK_BYTES, end)] for i in range(start, end, CHUNK_BYTES)]
    comm.recv_many(parts, src, tag)
    if times is not None:
        times["received"] = time.perf_counter()
    return _unpack(meta, buf)

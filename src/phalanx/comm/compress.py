"""Wire compression of pseudo-gradients (DiLoCo): fp16, bf16 and int8 min-max.

What goes on the wire is a dict of plain tensors (so it fits safetensors and
collectives alike); decoding always gives fp32 (or the fp64 of the input),
and sums are taken after decoding, never in the wire format.

int8 min-max: per tensor, ``q = round((x - lo) / s) - 128`` with
``s = (hi - lo) / 255``; decoding is ``(q + 128)·s + lo``. The error is at
most s/2 per element.
"""

from __future__ import annotations

from typing import Literal

import torch

Compression = Literal["none", "fp16", "bf16", "int8"]
COMPRESSIONS = ("none", "fp16", "bf16", "int8")


def accum_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def encode(t: torch.Tensor, how: Compression) -> dict[str, torch.Tensor]:
    """The wire form of ``t`` (contiguous, CPU or not)."""
    t = t.detach()
    if how == "none":
        return {"v": t.contiguous()}
    if how == "fp16":
        return {"v": t.to(torch.float16).contiguous()}
    if how == "bf16":
        return {"v": t.to(torch.bfloat16).contiguous()}
    if how == "int8":
        x = t.to(accum_dtype(t))
        lo, hi = (x.min(), x.max()) if x.numel() else (x.new_zeros(()), x.new_zeros(()))
        scale = (hi - lo) / 255
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round((x - lo) / safe) - 128
        return {
            "q": q.clamp(-128, 127).to(torch.int8).contiguous(),
            "lo": lo.reshape(1),
            "scale": scale.reshape(1),
        }
    raise ValueError(f"compression must be one of {list(COMPRESSIONS)}: got {how!r}.")


def decode(wire: dict[str, torch.Tensor], how: Compression, like: torch.Tensor) -> torch.Tensor:
    """Back to ``like``'s shape, in its accumulation dtype (fp32, or fp64)."""
    dt = accum_dtype(like)
    if how == "int8":
        q = wire["q"].to(dt)
        return ((q + 128) * wire["scale"].to(dt) + wire["lo"].to(dt)).reshape(like.shape)
    return wire["v"].to(dt).reshape(like.shape)


def wire_bytes(wire: dict[str, torch.Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in wire.values())

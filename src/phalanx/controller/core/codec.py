"""The compact JSON the journal and the payload log store, and the queues' checksums
are taken over."""

from __future__ import annotations

from typing import Any

from pydantic_core import to_json


def encode(record: Any) -> str:
    """Compact JSON, as ``json.dumps`` writes it but about 7x faster (pydantic-core's
    serializer): rollouts full of floats made the standard library's encoder the
    controller's top cost (docs/benchmarks.md, Transports). Non-finite floats are
    written as ``Infinity``/``NaN``, which ``json.loads`` reads back."""
    return to_json(record, inf_nan_mode="constants").decode()


def encode_bytes(record: Any) -> bytes:
    return to_json(record, inf_nan_mode="constants")

"""The compact JSON the journal and the payload log store."""

from __future__ import annotations

from typing import Any

from pydantic_core import to_json

from phalanx.protocol.base import MAX_INT


def encode(record: Any) -> str:
    """Compact JSON, as ``json.dumps`` writes it but about 7x faster (pydantic-core's
    serializer): rollouts full of floats made the standard library's encoder the
    controller's top cost (docs/benchmarks.md, Transports). Non-finite floats are
    written as ``Infinity``/``NaN``, which ``json.loads`` reads back."""
    return to_json(record, inf_nan_mode="constants").decode()


def encode_bytes(record: Any) -> bytes:
    return to_json(record, inf_nan_mode="constants")


def out_of_bounds(value: Any, where: str = "") -> str | None:
    """Where ``value`` holds an integer past the wire's bound (|n| > MAX_INT), which no
    reply type can carry and metrics cannot turn into a float; None if nowhere. The
    wire refuses such numbers; a journal written before it did may still hold them."""
    if isinstance(value, int) and not isinstance(value, bool):
        if abs(value) > MAX_INT:
            return f"{where or 'value'} is an integer of {value.bit_length()} bits"
    elif isinstance(value, dict):
        for k, v in value.items():
            if (why := out_of_bounds(v, f"{where}.{k}" if where else str(k))) is not None:
                return why
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if (why := out_of_bounds(v, f"{where}[{i}]")) is not None:
                return why
    return None


def drop_out_of_bounds(
    tables: dict[str, dict[str, dict[str, Any]]],
) -> list[tuple[str, str, str]]:
    """Remove from ``tables`` (in place) every record :func:`out_of_bounds` flags.
    Returns ``(table, key, why)`` for each, so that the caller deletes it from the
    journal and says so in the event log."""
    dropped = []
    for tbl, records in tables.items():
        for key in list(records):
            if (why := out_of_bounds(records[key])) is not None:
                del records[key]
                dropped.append((tbl, key, why))
    return dropped

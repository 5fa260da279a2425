"""The shape each journaled record must have, checked before a restore reads any.

The journal is written by the controller alone, but it is a file on a disk: a
record damaged by hand, by a tool or by another version (a member row that is a
JSON list, a step that is a string) made the restore fail deep inside the core
with a traceback, where every other damage is refused in one line. This checks
every record of the tables the core reads: that it is a JSON object, and that
the fields the core reads are there with the JSON type it expects. It says which
record and which field in one line (:class:`BadRecord`), and the service refuses
to start with it (``--fresh`` sets the journal aside).

Only the fields the restore reads are listed: a field a newer version added, or
an optional one, is not required. The tables of an older version that nothing
reads any more (:data:`~.base.RETIRED_TABLES`) are not checked: the restore
deletes them.
"""

from __future__ import annotations

from typing import Any

from phalanx.controller.core.codec import out_of_bounds

NUM = "number"
INT = "integer"
TEXT = "string"
BOOL = "boolean"
OBJ = "object"
LIST = "list"

Shape = dict[str, str]
"""Field -> the JSON type it must have."""

TABLES: dict[str, Shape] = {
    "members": {
        "replica_id": TEXT,
        "role": TEXT,
        "name": TEXT,
        "ranks": INT,
        "address": TEXT,
        "capabilities": OBJ,
        "registered_at": NUM,
        "step": INT,
    },
    "quorums": {
        "role": TEXT,
        "quorum_id": INT,
        "round": INT,
        "members": LIST,
        "max_step": INT,
        "heal": OBJ,
        "formed_at": NUM,
    },
    "commands": {"id": INT, "replica_id": TEXT, "kind": TEXT, "payload": OBJ, "created_at": NUM},
    "checkpoints": {"step": INT, "url": TEXT, "nbytes": INT, "by": TEXT, "role": TEXT, "at": NUM},
    "events": {"seq": INT, "kind": TEXT, "at": NUM},
    "prompts": {"index": INT, "attempt": INT, "state": TEXT},
    "leases": {
        "lease_id": TEXT,
        "replica_id": TEXT,
        "prompts": LIST,
        "version": INT,
        "issued_at": NUM,
    },
    "rollouts": {"rollout_id": TEXT, "prompt": INT, "version": INT, "seq": INT},
    "batches": {"index": INT, "step": INT, "rollout_ids": LIST},
    "rl_history": {"batch": INT},
    "lineage": {"index": INT, "rollouts": LIST},
    "payload_drops": {"reason": TEXT},
    "replay": {"rollout_id": TEXT, "prompt": INT, "version": INT, "ref": TEXT, "seq": INT},
    "replay_out": {"rollout_id": TEXT, "prompt": INT, "version": INT, "ref": TEXT},
    "episodes": {"rollout_id": TEXT, "key": TEXT, "bytes": INT, "episodes": INT, "turns": INT},
}
"""Per table, what each of its records must hold."""

META: dict[str, Shape] = {
    "epoch": {"value": INT},
    "event_seq": {"value": INT},
    "command_seq": {"value": INT},
    "role/": {"quorum_id": INT, "round": INT, "step": INT, "force_bump": BOOL},
    "desired/": {"value": INT},
}
"""The ``meta`` table's records, by key (a key ending in ``/`` is a prefix)."""

LEDGER_META: Shape = {
    "cursor": INT,
    "lease_seq": INT,
    "requeue": LIST,
    "seq": INT,
    "next_batch": INT,
    "policy_step": INT,
    "discarded": OBJ,
    "finished": BOOL,
    "counts": OBJ,
    "want_version": INT,
    "synced_version": INT,
    "sync_seq": INT,
    "mesh_id": INT,
    "mesh": LIST,
}
"""The ledger's one ``meta`` record."""


class BadRecord(ValueError):
    """A journaled record of the wrong shape (the message names it and the field)."""


def _is(value: Any, kind: str) -> bool:
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == NUM:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == TEXT:
        return isinstance(value, str)
    if kind == BOOL:
        return isinstance(value, bool)
    if kind == OBJ:
        return isinstance(value, dict)
    return isinstance(value, list)


def _json_type(value: Any) -> str:
    for kind in (BOOL, INT, NUM, TEXT, OBJ, LIST):
        if _is(value, kind):
            return "a JSON " + ("array" if kind == LIST else kind)
    return "null" if value is None else f"a {type(value).__name__}"


def _check(table: str, key: str, rec: Any, shape: Shape) -> None:
    if not isinstance(rec, dict):
        raise BadRecord(f"record {table}/{key} must be a JSON object: got {_json_type(rec)}")
    for name, kind in shape.items():
        if name not in rec:
            raise BadRecord(f"record {table}/{key} must have a field {name!r}: it has none")
        if not _is(rec[name], kind):
            raise BadRecord(
                f"record {table}/{key} must have {name!r} as a JSON {kind}: got "
                f"{_json_type(rec[name])}"
            )


def check(tables: dict[str, dict[str, Any]]) -> None:
    """Raise :class:`BadRecord` naming the first record of ``tables`` (as the journal
    loaded them) whose shape the restore cannot read. A record holding a number past
    the wire's bounds is left to the restore, which drops it and says so
    (:func:`~phalanx.controller.core.codec.drop_out_of_bounds`)."""
    for table, shape in TABLES.items():
        for key in sorted(tables.get(table, {})):
            rec = tables[table][key]
            if out_of_bounds(rec) is None:
                _check(table, key, rec, shape)
    for key in sorted(tables.get("meta", {})):
        for name, shape in META.items():
            if key == name or (name.endswith("/") and key.startswith(name)):
                _check("meta", key, tables["meta"][key], shape)
    ledger = tables.get("ledger", {})
    if "meta" in ledger:
        _check("ledger", "meta", ledger["meta"], LEDGER_META)

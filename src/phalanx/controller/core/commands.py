"""Command queues and checkpoint records.

A command is queued for a replica, polled by it at its step boundaries
(:mod:`phalanx.train.orders`) and acknowledged once acted on: ``drain``
(leave at the next step boundary) and ``checkpoint`` (save a given step).
A checkpoint, ordered or scheduled, ends in a record its saver reports.
"""

from __future__ import annotations

from typing import Any

from phalanx.controller.core.base import ChangeLog
from phalanx.protocol.commands import CheckpointRecord, Command

CHECKPOINT_HISTORY = 20
"""Committed checkpoints kept in the records (and the status), newest last."""


class Commands:
    def __init__(self, log: ChangeLog):
        self.log = log
        self.queues: dict[str, dict[int, Command]] = {}
        self.seq = 0

    def restore(self, tables: dict[str, dict[str, dict[str, Any]]], members: set[str]) -> None:
        self.seq = tables.get("meta", {}).get("command_seq", {}).get("value", 0)
        for rec in tables.get("commands", {}).values():
            c = Command.model_construct(**rec)
            if c.replica_id in members:
                self.queues.setdefault(c.replica_id, {})[c.id] = c

    def enqueue(
        self, replica_ids: list[str], kind: str, payload: dict[str, Any], wall: float
    ) -> list[Command]:
        """Queue one command per replica."""
        out = []
        for rid in replica_ids:
            self.seq += 1
            c = Command.model_construct(
                id=self.seq, replica_id=rid, kind=kind, payload=dict(payload), created_at=wall
            )
            self.queues.setdefault(rid, {})[c.id] = c
            self.log.put("commands", f"{c.id:012d}", c.model_dump())
            out.append(c)
        self.log.put("meta", "command_seq", {"value": self.seq})
        return out

    def pending(self, replica_id: str, after: int = 0) -> list[Command]:
        q = self.queues.get(replica_id, {})
        return [q[cid] for cid in sorted(q) if cid > after]

    def count(self, replica_id: str) -> int:
        return len(self.queues.get(replica_id, {}))

    def ack(self, replica_id: str, command_ids: list[int]) -> list[int]:
        """Acknowledge commands; returns the ids that were not pending (acked before)."""
        q = self.queues.get(replica_id, {})
        missing = []
        for cid in command_ids:
            if q.pop(cid, None) is None:
                missing.append(cid)
            else:
                self.log.put("commands", f"{cid:012d}", None)
        return missing

    def drop_for(self, replica_id: str) -> None:
        """A replica left: its unacknowledged commands go with it."""
        for cid in self.queues.pop(replica_id, {}):
            self.log.put("commands", f"{cid:012d}", None)


class CheckpointBook:
    def __init__(self, log: ChangeLog):
        self.log = log
        self.records: list[CheckpointRecord] = []
        """The last CHECKPOINT_HISTORY committed checkpoints, oldest first."""

    def restore(self, tables: dict[str, dict[str, dict[str, Any]]]) -> None:
        ck = tables.get("checkpoints", {})
        self.records = [CheckpointRecord.model_construct(**ck[k]) for k in sorted(ck)]

    def record(
        self, by: str, role: str, step: int, url: str, nbytes: int, wall: float
    ) -> CheckpointRecord:
        """Replica ``by`` committed a checkpoint: remember it (one record per step)."""
        rec = CheckpointRecord.model_construct(
            step=step, url=url, nbytes=nbytes, by=by, role=role, at=wall
        )
        self.records = sorted(
            [c for c in self.records if c.step != rec.step] + [rec], key=lambda c: c.step
        )
        self.log.put("checkpoints", f"{rec.step:012d}", rec.model_dump())
        while len(self.records) > CHECKPOINT_HISTORY:
            old = self.records.pop(0)
            self.log.put("checkpoints", f"{old.step:012d}", None)
        self.log.event(
            "checkpoint", wall, replica_id=rec.by, step=rec.step, url=rec.url, nbytes=rec.nbytes
        )
        return rec

    @property
    def latest(self) -> CheckpointRecord | None:
        return self.records[-1] if self.records else None

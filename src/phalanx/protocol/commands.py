"""Commands to replicas, the operator's actions and checkpoint reports.

A command is queued for one replica (or every replica of a role), polled by
the replica at its step boundaries and acknowledged once acted on. Kinds in
use: ``drain`` (leave at the next step boundary) and ``checkpoint`` (save the
step in the payload's ``step``); a payload is free-form, plain JSON.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator

from phalanx.protocol.base import (
    Count,
    Key,
    Name,
    ReplicaId,
    Reply,
    RoleName,
    Seq,
    Url,
    WaitS,
    Wall,
    Wire,
    check_plain_json,
)

Payload = Annotated[dict[Key, Any], Field(max_length=256)]


class Command(Wire):
    id: Seq
    replica_id: ReplicaId
    kind: Name
    payload: Payload = {}
    created_at: Wall


class PollReq(Wire):
    replica_id: ReplicaId
    after: Count = 0
    """Only commands with an id above this one."""
    wait_s: WaitS = 0.0


class CommandsReply(Reply):
    commands: Annotated[list[Command], Field(max_length=100_000)]


class AckReq(Wire):
    replica_id: ReplicaId
    ids: Annotated[list[Seq], Field(min_length=1, max_length=1000)]


class AckReply(Reply):
    not_pending: Annotated[list[Seq], Field(max_length=1000)]
    """Ids that were not pending (acknowledged before)."""


class EnqueueReq(Wire):
    target: Annotated[str, Field(min_length=1, max_length=160)]
    """A replica id, or a role name (every live replica of the role)."""
    kind: Name
    payload: Payload = {}

    _payload_is_plain_json = field_validator("payload")(check_plain_json)


class ScaleReq(Wire):
    role: RoleName
    replicas: int = Field(ge=0, le=100_000)


class ScaleReply(Reply):
    desired: Annotated[
        dict[RoleName, Annotated[int, Field(ge=0, le=100_000)]], Field(max_length=64)
    ]


class EvictReq(Wire):
    replica_id: ReplicaId
    reason: Annotated[str, Field(max_length=200)] = ""


class EvictReply(Reply):
    evicted: ReplicaId


class DrainReq(Wire):
    replica_id: ReplicaId


class TriggerCheckpointReq(Wire):
    lead_steps: int | None = Field(None, ge=1, le=1_000_000)
    """Checkpoint the step this many steps ahead of the job's current one (default:
    about two seconds of steps, at least 2, so every replica has polled by then)."""


class TriggerCheckpointReply(Reply):
    step: Count | None
    """The step every policy replica will checkpoint (None: no replica to ask)."""
    replicas: Count


class CheckpointReq(Wire):
    """A replica committed a checkpoint of ``step`` at ``url``."""

    replica_id: ReplicaId
    step: Count
    url: Url
    nbytes: Count


class CheckpointRecord(Wire):
    step: Count
    url: Url
    nbytes: Count
    by: ReplicaId
    role: RoleName
    at: Wall


class CheckpointReply(Reply):
    checkpoint: CheckpointRecord

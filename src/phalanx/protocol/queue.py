"""The controller's named rollout queues (``/v1/queue/*``): the ``controller``
backend of :class:`~phalanx.transport.base.RolloutQueue`.

A queued rollout is any JSON object with a string ``rollout_id``; the queue
knows nothing of prompts or steps. Every route needs the job token and
nothing else: a producer or consumer need not be a registered replica.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, field_validator

from phalanx.protocol.base import Count, Reply, Seq, WaitS, Wall, Wire, check_plain_json

MAX_BATCH = 4096
"""Rollouts (or deliveries) one request may carry."""
MAX_QUEUES = 64
"""Named queues one controller holds; a 65th name is refused (a typo, or a leak)."""

QueueName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]
QueuedId = Annotated[str, Field(min_length=1, max_length=256)]
Reason = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]


class QueuePutReq(Wire):
    queue: QueueName
    rollouts: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_BATCH)]
    """JSON objects, each with a string ``rollout_id`` (1 to 256 characters)."""

    @field_validator("rollouts")
    @classmethod
    def _ids_and_plain_json(cls, rollouts: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, r in enumerate(rollouts):
            rid = r.get("rollout_id")
            if not isinstance(rid, str) or not 1 <= len(rid) <= 256:
                raise ValueError(
                    f"rollouts[{i}].rollout_id must be a string of 1 to 256 characters: got "
                    f"{str(rid)[:80]!r}. Give every rollout its id."
                )
        check_plain_json(rollouts)
        return rollouts


class QueuePutReply(Reply):
    queued: Annotated[list[QueuedId], Field(max_length=MAX_BATCH)]
    """The ids queued; an id queued, leased or settled before is left out."""
    duplicates: Count


class QueueLeaseReq(Wire):
    queue: QueueName
    consumer: Annotated[str, Field(min_length=1, max_length=160)]
    """Who leases (a replica id, a process name): shown in the journal's lease records."""
    n: int = Field(1, ge=1, le=MAX_BATCH)
    lease_s: float = Field(30.0, gt=0, le=86400)
    """How long the rollouts are held before another consumer may take them."""
    wait_s: WaitS = 0.0


class QueueDelivery(Wire):
    rollout_id: QueuedId
    rollout: dict[str, Any]
    attempt: Seq
    """1 on the first delivery; more once a lease expired or was given back."""
    deadline: Wall
    """Wall-clock time after which another consumer may take it."""


class QueueLeaseReply(Reply):
    deliveries: Annotated[list[QueueDelivery], Field(max_length=MAX_BATCH)]


class DeliveryRef(Wire):
    rollout_id: QueuedId
    attempt: Seq
    """The delivery's attempt, as the lease returned it."""


class QueueSettleReq(Wire):
    queue: QueueName
    deliveries: Annotated[list[DeliveryRef], Field(min_length=1, max_length=MAX_BATCH)]


class QueueDiscardReq(QueueSettleReq):
    reason: Reason
    """Why (``stale``, ``duplicate``, ``rejected``...): counted per reason."""


class QueueSettleReply(Reply):
    settled: Count
    """Deliveries settled now (not acked, discarded or given back before)."""


class QueueStatusReq(Wire):
    queue: QueueName


class QueueCounts(Wire):
    pending: Count
    """Queued or leased: not yet acked nor discarded."""
    leased: Count
    put: Count
    acked: Count
    duplicates: Count
    corrupt: Count
    discarded: Annotated[dict[Reason, Count], Field(max_length=1000)]


class QueueStatusReply(QueueCounts, Reply):
    pass

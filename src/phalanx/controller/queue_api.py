"""HTTP API of the controller's rollout queues (:mod:`~phalanx.controller.queue_book`).

Every route needs the job token, and nothing else: a producer or consumer
need not be a registered replica (as with Redis or a spool, any process
holding the job's credentials may use the queue). Rejected input gets the
controller's usual 4xx body naming the field, and changes nothing.

- ``POST /v1/queue/put``: queue rollouts; ids seen before are dropped.
- ``POST /v1/queue/lease``: lease up to ``n``, long-polling up to ``wait_s``
  for the first (woken by a put or a nack, and when a lease expires).
- ``POST /v1/queue/{ack,nack,discard}``: settle deliveries, by (rollout id,
  attempt). Idempotent.
- ``POST /v1/queue/status``: pending, leased and the counters.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter
from fastapi.params import Depends
from pydantic import Field, field_validator

# app.py imports this module inside create_app, so these names are defined by then.
from phalanx.controller.app import API_VERSION, MAX_WAIT_S, _check_plain_json, _Req
from phalanx.controller.queue_book import MAX_BATCH
from phalanx.controller.service import ControllerService

QueueName = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]
RolloutId = Annotated[str, Field(min_length=1, max_length=256)]


class DeliveryRef(_Req):
    rollout_id: RolloutId
    attempt: int = Field(ge=1, le=2**62)
    """The delivery's attempt, as the lease returned it."""


class QueuePutReq(_Req):
    queue: QueueName
    rollouts: list[dict[str, Any]] = Field(min_length=1, max_length=MAX_BATCH)
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
        _check_plain_json(rollouts)
        return rollouts


class QueueLeaseReq(_Req):
    queue: QueueName
    consumer: Annotated[str, Field(min_length=1, max_length=160)]
    """Who leases (a replica id, a process name): shown in the journal's lease records."""
    n: int = Field(1, ge=1, le=MAX_BATCH)
    lease_s: float = Field(30.0, gt=0, le=86400)
    """How long the rollouts are held before another consumer may take them."""
    wait_s: float = Field(0.0, ge=0, le=MAX_WAIT_S)


class QueueStatusReq(_Req):
    queue: QueueName


class QueueSettleReq(_Req):
    queue: QueueName
    deliveries: list[DeliveryRef] = Field(min_length=1, max_length=MAX_BATCH)


class QueueDiscardReq(QueueSettleReq):
    reason: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    """Why (``stale``, ``duplicate``, ``rejected``...): counted per reason."""


def queue_routes(
    service: ControllerService, reply: Callable[..., dict[str, Any]], authorized: Depends
) -> APIRouter:
    router = APIRouter()
    queues = service.state.queues

    @router.post(f"/{API_VERSION}/queue/put", dependencies=[authorized])
    async def put(req: QueuePutReq) -> dict[str, Any]:
        """Queue rollouts. Replies with the ids queued; an id queued, leased or
        settled before is dropped and counted as a duplicate."""
        return reply(**service.apply(queues.put, req.queue, req.rollouts))

    @router.post(f"/{API_VERSION}/queue/lease", dependencies=[authorized])
    async def lease(req: QueueLeaseReq) -> dict[str, Any]:
        """Lease up to ``n`` rollouts for ``lease_s`` (expired leases first). Long-polls
        up to ``wait_s`` when there is none."""

        def call() -> dict[str, Any]:
            return service.apply(queues.lease, req.queue, req.consumer, req.n, req.lease_s)

        deadline = time.monotonic() + req.wait_s
        out = call()
        while not out["deliveries"]:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            book = queues.books.get(req.queue)
            expiry = book.next_expiry() if book is not None else None
            if expiry is not None:  # wake when the earliest lease ends, too
                left = min(left, max(0.0, expiry - service.clock()) + 0.005)
            await service.wait("queue", req.queue, left)
            out = call()
        return reply(**out)

    async def settle(req: QueueSettleReq, how: str, reason: str = "") -> dict[str, Any]:
        refs = [(d.rollout_id, d.attempt) for d in req.deliveries]
        return reply(**service.apply(queues.settle, req.queue, refs, how, reason))

    @router.post(f"/{API_VERSION}/queue/ack", dependencies=[authorized])
    async def ack(req: QueueSettleReq) -> dict[str, Any]:
        """These rollouts are consumed: never delivered again. ``settled`` counts the
        ones not acked or discarded before."""
        return await settle(req, "ack")

    @router.post(f"/{API_VERSION}/queue/nack", dependencies=[authorized])
    async def nack(req: QueueSettleReq) -> dict[str, Any]:
        """Give these deliveries back now, if still held under that attempt."""
        return await settle(req, "nack")

    @router.post(f"/{API_VERSION}/queue/discard", dependencies=[authorized])
    async def discard(req: QueueDiscardReq) -> dict[str, Any]:
        """Drop these rollouts for good, counted under ``reason``."""
        return await settle(req, "discard", req.reason)

    @router.post(f"/{API_VERSION}/queue/status", dependencies=[authorized])
    async def status(req: QueueStatusReq) -> dict[str, Any]:
        """``pending`` (queued or leased), ``leased``, and the counters: put, acked,
        duplicates, corrupt, discarded by reason."""
        return reply(**queues.status(req.queue))

    return router

"""Routes of the controller's rollout queues (:mod:`~phalanx.controller.core.queues`).

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

from phalanx.controller.http.base import Api, Route
from phalanx.protocol.queue import (
    QueueDelivery,
    QueueDiscardReq,
    QueueLeaseReply,
    QueueLeaseReq,
    QueuePutReply,
    QueuePutReq,
    QueueSettleReply,
    QueueSettleReq,
    QueueStatusReply,
    QueueStatusReq,
)


async def put(api: Api, req: QueuePutReq) -> QueuePutReply:
    """Queue rollouts. Replies with the ids queued; an id queued, leased or settled
    before is dropped and counted as a duplicate."""
    queues = api.state.queues
    added, dups = api.service.apply(queues.put, req.queue, list(req.rollouts))
    return QueuePutReply.model_construct(**api.envelope(), queued=added, duplicates=dups)


async def lease(api: Api, req: QueueLeaseReq) -> QueueLeaseReply:
    """Lease up to ``n`` rollouts for ``lease_s`` (expired leases first). Long-polls up
    to ``wait_s`` when there is none."""
    svc, queues = api.service, api.state.queues

    def call() -> list:
        return svc.apply(queues.lease, req.queue, req.consumer, req.n, req.lease_s)

    deadline = time.monotonic() + req.wait_s
    out = call()
    while not out:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        book = queues.books.get(req.queue)
        expiry = book.next_expiry() if book is not None else None
        if expiry is not None:  # wake when the earliest lease ends, too
            left = min(left, max(0.0, expiry - svc.clock()) + 0.005)
        await svc.wait("queue", req.queue, left)
        out = call()
    deliveries = [
        QueueDelivery.model_construct(
            rollout_id=d.rollout_id, rollout=d.rollout, attempt=d.attempt, deadline=d.deadline
        )
        for d in out
    ]
    return QueueLeaseReply.model_construct(**api.envelope(), deliveries=deliveries)


async def _settle(api: Api, req: QueueSettleReq, how: str, reason: str = "") -> QueueSettleReply:
    refs = [(d.rollout_id, d.attempt) for d in req.deliveries]
    n = api.service.apply(api.state.queues.settle, req.queue, refs, how, reason)
    return QueueSettleReply.model_construct(**api.envelope(), settled=n)


async def ack(api: Api, req: QueueSettleReq) -> QueueSettleReply:
    """These rollouts are consumed: never delivered again. ``settled`` counts the ones
    not acked or discarded before."""
    return await _settle(api, req, "ack")


async def nack(api: Api, req: QueueSettleReq) -> QueueSettleReply:
    """Give these deliveries back now, if still held under that attempt."""
    return await _settle(api, req, "nack")


async def discard(api: Api, req: QueueDiscardReq) -> QueueSettleReply:
    """Drop these rollouts for good, counted under ``reason``."""
    return await _settle(api, req, "discard", req.reason)


async def status(api: Api, req: QueueStatusReq) -> QueueStatusReply:
    """``pending`` (queued or leased), ``leased``, and the counters: put, acked,
    duplicates, corrupt, discarded by reason."""
    return QueueStatusReply(**api.envelope(), **api.state.queues.status(req.queue))


ROUTES = [
    Route("/v1/queue/put", put, QueuePutReq, QueuePutReply),
    Route("/v1/queue/lease", lease, QueueLeaseReq, QueueLeaseReply),
    Route("/v1/queue/ack", ack, QueueSettleReq, QueueSettleReply),
    Route("/v1/queue/nack", nack, QueueSettleReq, QueueSettleReply),
    Route("/v1/queue/discard", discard, QueueDiscardReq, QueueSettleReply),
    Route("/v1/queue/status", status, QueueStatusReq, QueueStatusReply),
]

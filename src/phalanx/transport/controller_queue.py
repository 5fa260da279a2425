"""A rollout queue held by the job's controller (``controller``): the embedded
backend, nothing to install.

The queue lives in the controller's core and journal, its rollouts in the
controller's payload log, so it survives a controller killed and restarted
on its state dir: queued, leased and settled rollouts, the deduplication
index and the counters all come back, and a lease held across the restart
keeps its holder (with a fresh deadline). This client speaks the queue's
part of the protocol (:mod:`phalanx.protocol.queue`) with the controller
transport's retries: a restarting controller is waited for, up to
``unreachable_timeout_s``, then :class:`TransportError`.

Deduplicated at put, like Redis: a put of an id the queue holds or has
settled is dropped and left out of the ids returned. A consumer may be any
process with the job's token; it need not be a registered replica.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel

from phalanx.client import ControllerClient, ControllerError, Rejected, Transport
from phalanx.protocol.base import MAX_WAIT_S
from phalanx.protocol.queue import (
    MAX_BATCH,
    DeliveryRef,
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
from phalanx.transport.base import Delivery, RolloutQueue, TransportError

R = TypeVar("R", bound=BaseModel)


class ControllerRolloutQueue(RolloutQueue):
    def __init__(
        self,
        controller: str | ControllerClient,
        name: str,
        consumer: str = "",
        *,
        lease_s: float = 30.0,
        token: str | None = None,
        unreachable_timeout_s: float = 30.0,
    ):
        """``controller``: its URL or state dir (the token is read there, or from
        ``$PHALANX_TOKEN``), or a replica's client to share. ``name`` picks the queue."""
        self.name, self.lease_s = name, lease_s
        self.consumer = consumer or f"queue-{uuid.uuid4().hex[:8]}"
        if isinstance(controller, ControllerClient):
            self.transport, self._own = controller.transport, False
        else:
            try:
                self.transport = Transport(
                    controller, token=token, unreachable_timeout_s=unreachable_timeout_s
                )
            except ControllerError as e:
                raise TransportError(f"controller rollout queue {name!r}: {e}") from e
            self._own = True

    def _call(self, path: str, req: BaseModel, reply: type[R], timeout: float = 30.0) -> R:
        try:
            return self.transport.call(f"/v1/queue/{path}", req, reply, timeout=timeout)
        except ControllerError as e:
            raise TransportError(f"controller rollout queue {self.name!r}: {e}") from e

    def put(self, rollouts: Sequence[Mapping[str, Any]]) -> list[str]:
        out: list[str] = []
        for i in range(0, len(rollouts), MAX_BATCH):
            out += self._put([dict(r) for r in rollouts[i : i + MAX_BATCH]])
        return out

    def _put(self, rollouts: list[dict[str, Any]]) -> list[str]:
        try:
            req = QueuePutReq(queue=self.name, rollouts=rollouts)
            return list(self.transport.call("/v1/queue/put", req, QueuePutReply).queued)
        except Rejected as e:
            if e.status != 413:
                raise TransportError(f"controller rollout queue {self.name!r}: {e}") from e
            if len(rollouts) == 1:
                raise TransportError(
                    f"rollout {rollouts[0].get('rollout_id')!r} must fit in one request to the "
                    f"controller: {e}. Raise controller.max_body_bytes, or use a redis:// or "
                    f"storage queue for rollouts this large."
                ) from e
            half = len(rollouts) // 2  # over the controller's body limit: send in halves
            return self._put(rollouts[:half]) + self._put(rollouts[half:])
        except ControllerError as e:
            raise TransportError(f"controller rollout queue {self.name!r}: {e}") from e

    def lease(self, n: int, wait_s: float = 0.0) -> list[Delivery]:
        until = time.monotonic() + max(wait_s, 0.0)
        while True:  # one long-poll holds at most MAX_WAIT_S
            wait = min(max(until - time.monotonic(), 0.0), MAX_WAIT_S)
            req = QueueLeaseReq(
                queue=self.name,
                consumer=self.consumer,
                n=max(1, min(n, MAX_BATCH)),
                lease_s=self.lease_s,
                wait_s=wait,
            )
            got = self._call("lease", req, QueueLeaseReply, timeout=wait + 10).deliveries
            if got or time.monotonic() >= until:
                break
        return [
            Delivery(d.rollout_id, d.rollout, f"{d.rollout_id}@{d.attempt}", d.attempt, d.deadline)
            for d in got
        ]

    def _settle(self, how: str, deliveries: Sequence[Delivery], reason: str = "") -> int:
        n = 0
        for i in range(0, len(deliveries), MAX_BATCH):
            refs = [
                DeliveryRef(rollout_id=d.rollout_id, attempt=d.attempt)
                for d in deliveries[i : i + MAX_BATCH]
            ]
            req: QueueSettleReq = (
                QueueDiscardReq(queue=self.name, deliveries=refs, reason=reason)
                if how == "discard"
                else QueueSettleReq(queue=self.name, deliveries=refs)
            )
            n += self._call(how, req, QueueSettleReply).settled
        return n

    def ack(self, deliveries: Sequence[Delivery]) -> int:
        return self._settle("ack", deliveries)

    def nack(self, deliveries: Sequence[Delivery]) -> int:
        return self._settle("nack", deliveries)

    def discard(self, deliveries: Sequence[Delivery], reason: str) -> int:
        return self._settle("discard", deliveries, reason)

    def _status(self) -> QueueStatusReply:
        return self._call("status", QueueStatusReq(queue=self.name), QueueStatusReply)

    def pending(self) -> int:
        return self._status().pending

    def counts(self) -> dict[str, Any]:
        s = self._status()
        return {
            "put": s.put,
            "acked": s.acked,
            "discarded": dict(s.discarded),
            "corrupt": s.corrupt,
            "duplicates": s.duplicates,
            "leased": s.leased,
        }

    def close(self) -> None:
        if self._own:
            self.transport.close()

"""Drain a rollout queue into the controller's ledger (policy replicas).

With ``rl.transport.rollouts`` set to a queue, rollout replicas put their
rollouts there instead of submitting them to the controller. Every policy
replica runs an :class:`Ingest` thread: it leases rollouts from the queue
(one consumer of the policy group), submits them to the ledger under the
prompt lease they were made for, and settles each with the ledger's verdict:

- accepted: ack;
- duplicate (a copy the ledger already holds: a redelivery after a consumer
  died between its submit and its ack, or a late copy): discard ``duplicate``;
- stale (made with too old weights): discard ``stale``;
- refused by the controller as malformed: discard ``rejected``.

If the controller cannot be reached, the rollouts are given back (nack) and
the thread retries. The ledger records each rollout id once, so what the
policy trains on is exactly-once even though the queue is at-least-once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from typing import Any

from phalanx.client import ControllerClient, ControllerError, Rejected
from phalanx.transport.base import Delivery, RolloutQueue, TransportError

log = logging.getLogger("phalanx.transport.ingest")

LEASE_KEY = "lease_id"
"""Field of a queued rollout naming the prompt lease it was made for (not sent to the ledger)."""


class Ingest:
    def __init__(
        self, queue: RolloutQueue, client: ControllerClient, batch: int = 64, wait_s: float = 0.5
    ):
        self.queue, self.client, self.batch, self.wait_s = queue, client, batch, wait_s
        self.counts: dict[str, int] = defaultdict(int)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="phalanx-ingest", daemon=True)

    def start(self) -> Ingest:
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.drain_once()
            except (TransportError, ControllerError, OSError) as e:
                log.warning("rollout ingest: %s; retrying", e)
                self._stop.wait(1.0)

    def drain_once(self) -> int:
        """Lease, submit and settle one round; returns the rollouts leased."""
        got = self.queue.lease(self.batch, self.wait_s)
        by_lease: dict[str, list[Delivery]] = defaultdict(list)
        for d in got:
            by_lease[str(d.rollout.get(LEASE_KEY, "queued"))].append(d)
        for lease_id, ds in by_lease.items():
            self._submit(lease_id, ds)
        return len(got)

    def _submit(self, lease_id: str, ds: list[Delivery]) -> None:
        rollouts = [{k: v for k, v in d.rollout.items() if k != LEASE_KEY} for d in ds]
        try:
            out: dict[str, Any] = self.client.submit_rollouts(lease_id, rollouts)
        except Rejected as e:
            if e.status >= 500 or e.status in (401, 403, 404, 409, 410):
                self.queue.nack(ds)  # not the rollouts' fault: try again later
                raise
            self.queue.discard(ds, "rejected")
            self.counts["rejected"] += len(ds)
            log.warning("rollout ingest: the controller refused %d rollouts: %s", len(ds), e)
            return
        except ControllerError:
            self.queue.nack(ds)
            raise
        by_id = {d.rollout_id: d for d in ds}
        accepted = [by_id[r] for r in out["accepted"] if r in by_id]
        self.queue.ack(accepted)
        self.counts["accepted"] += len(accepted)
        for reason in ("duplicate", "stale"):
            if out[reason]:
                self.queue.discard([by_id[r] for r in out[reason] if r in by_id], reason)
                self.counts[reason] += len(out[reason])


def wait_idle(queue: RolloutQueue, timeout_s: float) -> bool:
    """Until the queue holds nothing (tests); True if it emptied in time."""
    until = time.monotonic() + timeout_s
    while queue.pending() and time.monotonic() < until:
        time.sleep(0.05)
    return queue.pending() == 0

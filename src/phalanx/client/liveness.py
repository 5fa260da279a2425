"""A replica's signs of life: the heartbeat thread, the lifeline thread, and the
progress the heartbeats carry.

- The **heartbeat** is held by the controller up to one interval and answered
  at once when a peer suspects the replica (``probe``): the replica then
  heartbeats again at once, proving it is alive within ``suspect_grace_s``.
  It carries what the training loop last reported (:meth:`Liveness.report`,
  :meth:`Liveness.report_heal`).
- The **lifeline** is a request held open for as long as the process lives;
  the kernel closes its connection when the process dies, however it dies,
  and the controller suspects the replica at once. The held heartbeat alone
  leaves a gap between one reply and the next request, which a busy process
  can stretch to seconds.

An evicted incarnation (410) registers again, through the client.
"""

from __future__ import annotations

import math
import threading
import time
from typing import TYPE_CHECKING

from phalanx.client.transport import ControllerError, Evicted, Rejected
from phalanx.protocol.base import Reply
from phalanx.protocol.membership import HealedReport, HeartbeatReply, HeartbeatReq, LifelineReq

if TYPE_CHECKING:
    from phalanx.client.replica import ControllerClient

LIFELINE_HOLD_S = 10.0
"""How long one lifeline request is held; the client re-posts it at once."""


class Liveness:
    def __init__(self, client: ControllerClient):
        self.client = client
        self.progress = HeartbeatReq(replica_id="-")
        """step, loss and inner_step for the next heartbeat (its replica_id is unused)."""
        self.healed: HealedReport | None = None
        self.stopped = threading.Event()
        self.heartbeats = 0
        self.probes_answered = 0
        self._hb_http = client.transport.http_client()
        self._ll_http = client.transport.http_client()
        self._threads: list[threading.Thread] = []

    # -- what the training loop reports ----------------------------------

    def report(self, step: int | None, loss: float | None, inner_step: int | None) -> None:
        p = self.progress
        if loss is not None and not math.isfinite(loss):
            loss = None  # the wire takes finite numbers only
        self.progress = p.model_copy(
            update={
                "step": p.step if step is None else step,
                "loss": p.loss if loss is None else loss,
                "inner_step": p.inner_step if inner_step is None else inner_step,
            }
        )

    def report_heal(self, source: str, step: int, seconds: float, quorum_id: int) -> None:
        seconds = min(max(seconds, 0.0), 86400.0)
        self.healed = HealedReport(source=source, step=step, seconds=seconds, quorum_id=quorum_id)

    def last_word(self, replica_id: str) -> HeartbeatReq | None:
        """A last heartbeat before leaving, if there is progress it may not have carried."""
        if self.progress.step is None:
            return None
        healed, self.healed = self.healed, None
        return HeartbeatReq(replica_id=replica_id, step=self.progress.step, healed=healed)

    # -- threads ---------------------------------------------------------

    def start(self) -> None:
        """Start the heartbeat and lifeline threads (idempotent)."""
        if self._threads:
            return
        name = self.client.name
        for target, what in (
            (self._heartbeat_loop, "heartbeat"),
            (self._lifeline_loop, "lifeline"),
        ):
            t = threading.Thread(target=target, name=f"phalanx-{what}-{name}", daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self.stopped.set()
        if self._threads:
            self._threads[0].join(timeout=5)
        self._hb_http.close()
        self._ll_http.close()

    def _running(self) -> bool:
        return not self.stopped.is_set() and not self.client.leaving

    def _heartbeat_loop(self) -> None:
        c = self.client
        interval = c.timeouts.heartbeat_interval_s if c.timeouts is not None else 1.0
        while self._running():
            t0 = time.monotonic()
            rid, healed = c.replica_id, self.healed
            if rid is None:
                self.stopped.wait(0.05)
                continue
            req = self.progress.model_copy(
                update={"replica_id": rid, "wait_s": interval, "healed": healed}
            )
            try:
                r = c.transport.call(
                    "/v1/heartbeat", req, HeartbeatReply, timeout=interval + 10, http=self._hb_http
                )
                if self.healed is healed:
                    self.healed = None  # reported
                self.heartbeats += 1
                if r.probe:
                    self.probes_answered += 1
                    continue  # a peer suspects us: prove we are alive at once
            except Evicted:
                c.reregister(rid)
                continue
            except ControllerError as e:
                if self.stopped.is_set():
                    return
                c.log.error("heartbeat failing: %s", e)
            self.stopped.wait(max(0.0, interval - (time.monotonic() - t0)))

    def _lifeline_loop(self) -> None:
        c = self.client
        while self._running():
            rid = c.replica_id
            if rid is None:
                self.stopped.wait(0.05)
                continue
            try:
                c.transport.call(
                    "/v1/lifeline",
                    LifelineReq(replica_id=rid, wait_s=LIFELINE_HOLD_S),
                    Reply,
                    timeout=LIFELINE_HOLD_S + 10,
                    http=self._ll_http,
                )
            except Evicted:
                # The heartbeat thread registers the new incarnation: hold for it.
                while c.replica_id == rid and not self.stopped.wait(0.05):
                    pass
            except Rejected as e:  # a controller without lifelines (404): do without
                c.log.warning("no lifeline: the controller answered %s", e)
                return
            except ControllerError:
                if self.stopped.wait(0.5):
                    return
            except RuntimeError:
                # stop() closes this thread's client without waiting out a held call:
                # a call begun after that finds it closed, and the thread ends.
                if self.stopped.is_set():
                    return
                raise

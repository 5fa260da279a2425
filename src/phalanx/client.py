"""Replica-side controller client.

One per replica process (rank 0 of a replica talks to the controller on
its behalf). It registers, keeps a heartbeat going on a background thread,
and asks for quorums, commands and failure reports over HTTP (httpx).

Failures it hides, and how:

- **Transient network errors and a restarting controller**: every call
  retries with exponential backoff and full jitter. A controller restarted
  on the same state dir keeps the membership, so the replica just carries
  on; the client logs the new controller epoch. Given a state dir instead
  of a URL, the client re-reads ``DIR/url`` while it retries, in case the
  controller came back on another port.
- **Eviction** (the controller answers 410: this incarnation is gone, e.g.
  after a SIGSTOP outlived the heartbeat timeout): the client registers a
  new incarnation under the same name and bumps :attr:`incarnations`. The
  training layer must then treat itself as a new joiner (heal).

Failures it raises: :class:`ControllerUnreachable` after
``unreachable_timeout_s`` of failed attempts, :class:`Rejected` for a
request the controller refused (4xx, with the field it named), and
:class:`QuorumTimeout`.
"""

from __future__ import annotations

import logging
import os
import random
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from phalanx import env
from phalanx.controller.records import Quorum
from phalanx.log import ReplicaLogger, Who

log = logging.getLogger("phalanx.client")


class ControllerError(RuntimeError):
    pass


class ControllerUnreachable(ControllerError):
    pass


class Rejected(ControllerError):
    def __init__(self, status: int, body: dict[str, Any]):
        self.status = status
        self.body = body
        fields = ", ".join(f"{f['field']}: {f['message']}" for f in body.get("fields", []))
        super().__init__(
            f"controller refused the request ({status}): {body.get('error')}"
            + (f" [{fields}]" if fields else "")
        )


class Evicted(Rejected):
    """This incarnation is no longer a member (HTTP 410)."""


class QuorumTimeout(ControllerError):
    pass


def resolve(controller: str) -> tuple[str, Path | None]:
    """A controller is named by URL or by state dir. Returns (url, state_dir)."""
    if controller.startswith(("http://", "https://")):
        return controller.rstrip("/"), None
    d = Path(controller)
    url_file = d / "url" if d.is_dir() else d
    try:
        return url_file.read_text().strip().rstrip("/"), url_file.parent
    except OSError as e:
        raise ControllerError(
            f"controller must be a URL (http://host:port) or a controller state dir with a "
            f"'url' file: got {controller!r} ({e.strerror})."
        ) from None


def find_token(state_dir: Path | None) -> str:
    token = os.environ.get(env.TOKEN)
    if token:
        return token
    if state_dir is not None and (state_dir / "token").exists():
        return (state_dir / "token").read_text().strip()
    raise ControllerError(
        f"a job token is needed to talk to the controller: set ${env.TOKEN}, or name the "
        f"controller by its state dir so the token file can be read."
    )


LIFELINE_HOLD_S = 10.0
"""How long one lifeline request is held; the client re-posts it at once."""


class ControllerClient:
    def __init__(
        self,
        controller: str,
        role: str,
        name: str,
        *,
        ranks: int = 1,
        address: str = "",
        capabilities: dict[str, Any] | None = None,
        token: str | None = None,
        unreachable_timeout_s: float = 30.0,
        rank: int = 0,
    ):
        self.url, self.state_dir = resolve(controller)
        self.token = token or find_token(self.state_dir)
        self.role, self.name, self.ranks = role, name, ranks
        self.address = address
        self.capabilities = dict(capabilities or {})
        self.unreachable_timeout_s = unreachable_timeout_s
        self.replica_id: str | None = None
        self.epoch: int | None = None
        self.incarnations = 0
        self.step: int | None = None
        """Committed step, reported with each heartbeat (set by the training loop)."""
        self.loss: float | None = None
        """The loss of the last committed step, sent with heartbeats (for the dashboard)."""
        self.inner_step: int | None = None
        """DiLoCo: inner steps taken so far, sent with heartbeats (for the dashboard)."""
        self.healed: dict[str, Any] | None = None
        """A finished heal (``source``, ``step``, ``seconds``, ``quorum_id``): the next
        heartbeat reports it once (the dashboard's timeline shows it)."""
        self.timeouts: dict[str, float] = {}
        self.who = Who(role=role, replica_id=name, rank=rank)
        self.log = ReplicaLogger(log, self.who)
        headers = {"Authorization": f"Bearer {self.token}"}
        self._http = httpx.Client(headers=headers, timeout=30.0)
        self._hb_http = httpx.Client(headers=headers, timeout=30.0)
        self._ll_http = httpx.Client(headers=headers, timeout=30.0)
        self._reg_lock = threading.Lock()
        self._closed = threading.Event()
        self._leaving = False
        self._hb_thread: threading.Thread | None = None
        self._ll_thread: threading.Thread | None = None
        self.heartbeats = 0
        self.probes_answered = 0

    # -- transport -------------------------------------------------------

    def _call(
        self,
        path: str,
        body: dict[str, Any] | None = None,
        *,
        timeout: float = 30.0,
        http: httpx.Client | None = None,
    ) -> dict[str, Any]:
        http = http or self._http
        first_failure: float | None = None
        backoff = 0.05
        last_error = ""
        while True:
            try:
                if body is None:
                    r = http.get(self.url + path, timeout=timeout)
                else:
                    r = http.post(self.url + path, json=body, timeout=timeout)
                if r.status_code < 500:
                    return self._handle(r)
                last_error = f"HTTP {r.status_code}: {r.text[:200]}"
            except httpx.TransportError as e:
                last_error = f"{type(e).__name__}: {e}"
            if self._closed.is_set():
                raise ControllerUnreachable(f"client closed while calling {path}")
            now = time.monotonic()
            first_failure = first_failure or now
            if now - first_failure > self.unreachable_timeout_s:
                raise ControllerUnreachable(
                    f"controller at {self.url} unreachable for {now - first_failure:.0f} s "
                    f"(last error: {last_error})"
                )
            time.sleep(random.uniform(0, backoff))
            backoff = min(backoff * 2, 2.0)
            if self.state_dir is not None:
                try:
                    self.url = resolve(str(self.state_dir))[0]
                except ControllerError:
                    pass

    def request(
        self, path: str, body: dict[str, Any] | None = None, *, timeout: float = 30.0
    ) -> dict[str, Any]:
        """One call of the controller's API that needs no membership (the job token
        is enough), with this client's retries: GET without ``body``, else POST.
        Raises like every call here (:class:`Rejected`, :class:`ControllerUnreachable`)."""
        return self._call(path, body, timeout=timeout)

    def _handle(self, r: httpx.Response) -> dict[str, Any]:
        try:
            data = r.json()
        except ValueError:
            data = {"error": r.text[:200]}
        if r.status_code == 410:
            raise Evicted(r.status_code, data)
        if r.status_code == 401:
            raise ControllerError(
                f"controller at {self.url} refused the job token (401): check ${env.TOKEN} "
                f"or the state dir's token file."
            )
        if r.status_code >= 400:
            raise Rejected(r.status_code, data)
        epoch = data.get("epoch")
        if epoch is not None and epoch != self.epoch:
            if self.epoch is not None:
                self.log.warning(
                    "controller restarted (epoch %s -> %s); resuming", self.epoch, epoch
                )
            self.epoch = epoch
        return data

    # -- membership ------------------------------------------------------

    def register(self) -> str:
        """Register a new incarnation of this replica. Idempotent per call site:
        a second call replaces the first incarnation."""
        data = self._call(
            "/v1/register",
            {
                "role": self.role,
                "name": self.name,
                "ranks": self.ranks,
                "address": self.address,
                "capabilities": self.capabilities,
            },
        )
        self.replica_id = data["replica_id"]
        self.incarnations += 1
        self.healed = None  # a heal of an earlier incarnation is not this one's
        self.timeouts = {k: v for k, v in data.items() if k.endswith("_s")}
        self.who.replica_id = self.replica_id
        self.log.info("registered (epoch %s)", data["epoch"])
        return self.replica_id

    def _reregister(self, stale_id: str | None) -> None:
        with self._reg_lock:
            if self.replica_id == stale_id and not self._leaving and not self._closed.is_set():
                self.log.warning("evicted by the controller; registering a new incarnation")
                self.register()

    def _as_member(self, fn: Any) -> Any:
        """Run ``fn(replica_id)``; if this incarnation was evicted, re-register and retry."""
        if self.replica_id is None:
            self.register()
        while True:
            rid = self.replica_id
            try:
                return fn(rid)
            except Evicted:
                self._reregister(rid)

    def start_heartbeat(self) -> None:
        """Start the background heartbeat thread (idempotent)."""
        if self.replica_id is None:
            self.register()
        if self._hb_thread is None:
            self._hb_thread = threading.Thread(
                target=self._heartbeat_loop, name=f"phalanx-heartbeat-{self.name}", daemon=True
            )
            self._hb_thread.start()
        if self._ll_thread is None:
            self._ll_thread = threading.Thread(
                target=self._lifeline_loop, name=f"phalanx-lifeline-{self.name}", daemon=True
            )
            self._ll_thread.start()

    def _heartbeat_loop(self) -> None:
        interval = self.timeouts.get("heartbeat_interval_s", 1.0)
        while not self._closed.is_set() and not self._leaving:
            t0 = time.monotonic()
            rid = self.replica_id
            healed = self.healed
            try:
                data = self._call(
                    "/v1/heartbeat",
                    {
                        "replica_id": rid,
                        "step": self.step,
                        "loss": self.loss,
                        "inner_step": self.inner_step,
                        "wait_s": interval,
                        **({"healed": healed} if healed is not None else {}),
                    },
                    timeout=interval + 10,
                    http=self._hb_http,
                )
                if self.healed is healed:
                    self.healed = None  # reported
                self.heartbeats += 1
                if data.get("probe"):
                    self.probes_answered += 1
                    continue  # a peer suspects us: prove we are alive at once
            except Evicted:
                self._reregister(rid)
                continue
            except ControllerError as e:
                if self._closed.is_set():
                    return
                self.log.error("heartbeat failing: %s", e)
            self._closed.wait(max(0.0, interval - (time.monotonic() - t0)))

    def _lifeline_loop(self) -> None:
        """Keep a request held open at the controller (``/v1/lifeline``) for as long
        as this process lives. The kernel closes its connection when the process
        dies, however it dies, and the controller suspects the replica at once; the
        held heartbeat alone leaves a gap between one reply and the next request,
        which a busy process can stretch to seconds."""
        while not self._closed.is_set() and not self._leaving:
            rid = self.replica_id
            try:
                self._call(
                    "/v1/lifeline",
                    {"replica_id": rid, "wait_s": LIFELINE_HOLD_S},
                    timeout=LIFELINE_HOLD_S + 10,
                    http=self._ll_http,
                )
            except Evicted:
                # The heartbeat thread registers the new incarnation: hold for it.
                while self.replica_id == rid and not self._closed.wait(0.05):
                    pass
            except Rejected as e:  # a controller without lifelines (404): do without
                self.log.warning("no lifeline: the controller answered %s", e)
                return
            except ControllerError:
                if self._closed.wait(0.5):
                    return

    def deregister(self, reason: str = "") -> None:
        """Leave the job for good: the heartbeat stops re-registering."""
        if self.replica_id is None:
            return
        self._leaving = True
        try:
            if self.step is not None:
                # The heartbeat may not have carried the last commits yet: report them,
                # or the job's step stays behind and a replica started after the job
                # ended does not see it finished (it would train it again from scratch).
                last: dict[str, Any] = {"replica_id": self.replica_id, "step": self.step}
                if self.healed is not None:
                    last["healed"] = self.healed
                self._call("/v1/heartbeat", last)
                self.healed = None
            self._call("/v1/deregister", {"replica_id": self.replica_id, "reason": reason})
        except Evicted:
            pass
        self.replica_id = None

    def close(self, reason: str = "") -> None:
        """Leave the job (deregister) and stop the heartbeat thread."""
        try:
            if self.replica_id is not None and reason is not None:
                self.deregister(reason or "closed")
        finally:
            self._closed.set()
            if self._hb_thread is not None:
                self._hb_thread.join(timeout=5)
            self._http.close()
            self._hb_http.close()
            self._ll_http.close()

    def __enter__(self) -> ControllerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- quorum ----------------------------------------------------------

    def quorum(self, step: int, timeout_s: float | None = None) -> Quorum:
        """Block until this replica is in a quorum of its role for ``step``.

        Call it once per step from the replica's rank 0, with the replica's
        committed step. Safe to retry: one call is one request id, so a
        controller that answered before a network error answers the same
        quorum again. Raises :class:`QuorumTimeout` after ``timeout_s``
        (default: the job's ``timeouts.quorum_s``)."""
        timeout_s = timeout_s or self.timeouts.get("quorum_timeout_s", 60.0)
        request_id = uuid.uuid4().hex
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise QuorumTimeout(
                    f"no quorum for role {self.role} at step {step} within {timeout_s:.1f} s: "
                    f"too few replicas asked (see min_replicas / n_init_replicas in the job config)"
                )
            wait = min(10.0, left)

            def ask(rid: str, wait: float = wait, left: float = left) -> dict[str, Any]:
                return self._call(
                    "/v1/quorum",
                    {
                        "replica_id": rid,
                        "step": step,
                        "request_id": request_id,
                        "timeout_s": left,
                        "wait_s": wait,
                    },
                    timeout=wait + 10,
                )

            data = self._as_member(ask)
            if data["status"] == "ok":
                q = Quorum.from_record(data["quorum"])
                self.who.quorum_id = q.quorum_id
                return q

    # -- failures and commands -------------------------------------------

    def report_failure(
        self, suspects: list[str], reason: str = "", failed_commit: bool = False
    ) -> list[str]:
        """Report peers seen failing (e.g. a collective error). Returns the suspects the
        controller did not know (already evicted)."""
        data = self._as_member(
            lambda rid: self._call(
                "/v1/report-failure",
                {
                    "reporter": rid,
                    "suspects": [s for s in suspects if s != rid],
                    "reason": reason[:1000],
                    "failed_commit": failed_commit,
                },
            )
        )
        return data["unknown"]

    def poll_commands(self, after: int = 0, wait_s: float = 10.0) -> list[dict[str, Any]]:
        """Long-poll this replica's unacknowledged commands with id > ``after``."""
        data = self._as_member(
            lambda rid: self._call(
                "/v1/commands/poll",
                {"replica_id": rid, "after": after, "wait_s": wait_s},
                timeout=wait_s + 10,
            )
        )
        return data["commands"]

    def ack(self, ids: list[int]) -> list[int]:
        data = self._as_member(
            lambda rid: self._call("/v1/commands/ack", {"replica_id": rid, "ids": ids})
        )
        return data["not_pending"]

    def enqueue(self, target: str, kind: str, payload: dict[str, Any] | None = None) -> list[dict]:
        """Queue a command for a replica id or for every replica of a role."""
        data = self._call(
            "/v1/commands", {"target": target, "kind": kind, "payload": payload or {}}
        )
        return data["commands"]

    def status(self) -> dict[str, Any]:
        return self._call("/v1/status")

    # -- RL ledger -------------------------------------------------------

    def lease_prompts(self, version: int, max_prompts: int, wait_s: float = 10.0) -> dict:
        """Rollout replicas: lease up to ``max_prompts`` prompts while holding weights
        ``version`` (-1: none yet). Long-polls up to ``wait_s``. The reply's ``sync``
        (when set) is a weight-sync order to join *before* generating."""
        return self._as_member(
            lambda rid: self._call(
                "/v1/prompts/lease",
                {
                    "replica_id": rid,
                    "version": version,
                    "max_prompts": max_prompts,
                    "wait_s": wait_s,
                },
                timeout=wait_s + 10,
            )
        )

    def submit_rollouts(self, lease_id: str, rollouts: list[dict[str, Any]]) -> dict:
        """Rollout replicas: submit a lease's rollouts (safe to retry: ids dedupe)."""
        return self._as_member(
            lambda rid: self._call(
                "/v1/rollouts/submit",
                {"replica_id": rid, "lease_id": lease_id, "rollouts": rollouts},
            )
        )

    def lease_batch(self, step: int, wait_s: float = 10.0) -> dict:
        """Policy replicas: the rollout batch of ``step`` (same for every replica)."""
        return self._as_member(
            lambda rid: self._call(
                "/v1/rollouts/lease",
                {"replica_id": rid, "step": step, "wait_s": wait_s},
                timeout=wait_s + 10,
            )
        )

    def ack_batch(self, step: int) -> dict:
        """Policy replicas: committed up to ``step``; the batches it covers are trained."""
        return self._as_member(
            lambda rid: self._call("/v1/rollouts/ack", {"replica_id": rid, "step": step})
        )

    def sync_done(self, seq: int, version: int, ok: bool, error: str = "") -> dict:
        """Report the end of weight sync ``seq`` (every mesh member, leader included)."""
        return self._as_member(
            lambda rid: self._call(
                "/v1/weights/done",
                {
                    "replica_id": rid,
                    "seq": seq,
                    "version": version,
                    "ok": ok,
                    "error": error[:1000],
                },
            )
        )

    def checkpoint_committed(self, step: int, url: str, nbytes: int) -> dict[str, Any]:
        """Tell the controller that this replica committed a checkpoint of ``step``."""
        return self._as_member(
            lambda rid: self._call(
                "/v1/checkpoints", {"replica_id": rid, "step": step, "url": url, "nbytes": nbytes}
            )
        )["checkpoint"]

    def scale(self, role: str, replicas: int) -> dict[str, int]:
        """Ask the job's launcher for ``replicas`` replicas of ``role``."""
        return self._call("/v1/scale", {"role": role, "replicas": replicas})["desired"]

"""The controller's HTTP API (FastAPI): versioned JSON under ``/v1``.

Every endpoint but ``/healthz`` and the dashboard's static files (``/``,
``/dashboard/*``, which hold no job data) needs the job token as a bearer token.
Rejected input gets a 4xx JSON body ``{"error": ..., "fields": [...]}`` that
names the field, and never changes state (the state machine validates
before it mutates). Every reply carries the controller epoch, in the body
and in the ``X-Phalanx-Epoch`` header, so a replica can tell that the
controller restarted.

Long-polls (heartbeat, quorum, commands) hold the request open for at most
``wait_s`` and answer early when the state machine has news for the caller.
The rollout-queue routes (``/v1/queue/*``) live in ``queue_api.py``.
"""

from __future__ import annotations

import asyncio
import hmac
import math
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.security.utils import get_authorization_scheme_param
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from phalanx.controller.dashboard import dashboard_routes, is_public
from phalanx.controller.quorum import QUORUM_HISTORY
from phalanx.controller.records import Quorum
from phalanx.controller.service import ControllerService
from phalanx.controller.tick import StateError

API_VERSION = "v1"
MAX_WAIT_S = 30.0

ReplicaId = Annotated[str, Field(min_length=1, max_length=160)]
Name = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
Scalar = str | int | float | bool | None


_bearer = HTTPBearer(auto_error=False)
_JSON = TypeAdapter(dict[str, Any])


MAX_PAYLOAD_DEPTH = 32


class _Req(BaseModel):
    # NaN and infinities are not JSON: refuse them here rather than store values
    # that a reply cannot carry.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


def _check_plain_json(value: Any) -> Any:
    """Refuse free-form values that the replies could not serialize: non-finite
    numbers, strings with lone surrogates, and nesting past MAX_PAYLOAD_DEPTH.
    Iterative, so a deep payload cannot exhaust the stack."""
    todo = [(value, 0)]
    while todo:
        v, depth = todo.pop()
        if depth > MAX_PAYLOAD_DEPTH:
            raise ValueError(f"must nest at most {MAX_PAYLOAD_DEPTH} levels deep")
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"must hold finite numbers only: got {v}")
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("must hold valid Unicode text (no lone surrogates)") from None
        elif isinstance(v, dict):
            todo.extend((x, depth + 1) for kv in v.items() for x in kv)
        elif isinstance(v, list):
            try:
                # A list of numbers (token ids, log-probs) is checked in one pass in
                # C: walking a rollout's thousand floats one by one was a tenth of
                # the controller's time per put. Anything else is walked below.
                if depth < MAX_PAYLOAD_DEPTH and all(map(math.isfinite, v)):
                    continue
            except (TypeError, OverflowError):
                pass
            todo.extend((x, depth + 1) for x in v)
    return value


class RegisterReq(_Req):
    role: Annotated[str, Field(min_length=1, max_length=32)]
    name: Name
    ranks: int = Field(1, ge=1, le=65536)
    address: str = Field("", max_length=256)
    capabilities: dict[Annotated[str, Field(max_length=64)], Scalar] = Field(
        default_factory=dict, max_length=64
    )


class HealedReport(_Req):
    """A heal this replica finished (sent once, with its next heartbeat)."""

    source: ReplicaId
    """The replica it healed from."""
    step: int = Field(ge=0, le=2**62)
    seconds: float = Field(ge=0, le=86400)
    quorum_id: int = Field(ge=0, le=2**62)


class HeartbeatReq(_Req):
    replica_id: ReplicaId
    step: int | None = Field(None, ge=0, le=2**62)
    loss: float | None = None
    """Training loss at ``step`` (optional; charted by the dashboard)."""
    inner_step: int | None = Field(None, ge=0, le=2**62)
    """DiLoCo: inner steps taken so far, the current round's included (optional;
    shown by the dashboard while a round runs)."""
    wait_s: float = Field(0.0, ge=0, le=MAX_WAIT_S)
    healed: HealedReport | None = None
    """A heal finished since the last heartbeat (shown on the timeline, with its time)."""


class LifelineReq(_Req):
    replica_id: ReplicaId
    wait_s: float = Field(0.0, ge=0, le=MAX_WAIT_S)
    """How long to hold the request (the client sends ``LIFELINE_HOLD_S``)."""


class QuorumReq(_Req):
    replica_id: ReplicaId
    step: int = Field(ge=0, le=2**62)
    request_id: Annotated[str, Field(min_length=1, max_length=64)]
    timeout_s: float = Field(60.0, gt=0, le=86400)
    wait_s: float = Field(10.0, ge=0, le=MAX_WAIT_S)


class PollReq(_Req):
    replica_id: ReplicaId
    after: int = Field(0, ge=0, le=2**62)
    wait_s: float = Field(0.0, ge=0, le=MAX_WAIT_S)


class AckReq(_Req):
    replica_id: ReplicaId
    ids: list[Annotated[int, Field(ge=1, le=2**62)]] = Field(min_length=1, max_length=1000)


class EnqueueReq(_Req):
    target: Annotated[str, Field(min_length=1, max_length=160)]
    kind: Name
    payload: dict[Annotated[str, Field(max_length=64)], Any] = Field(
        default_factory=dict, max_length=256
    )

    _payload_is_plain_json = field_validator("payload")(_check_plain_json)


class ReportReq(_Req):
    reporter: ReplicaId
    suspects: list[ReplicaId] = Field(default_factory=list, max_length=1000)
    reason: str = Field("", max_length=1000)
    failed_commit: bool = False


class DeregisterReq(_Req):
    replica_id: ReplicaId
    reason: str = Field("", max_length=1000)


class PromptLeaseReq(_Req):
    replica_id: ReplicaId
    version: int = Field(ge=-1, le=2**62)
    """Weights version the replica holds; -1 before it has any."""
    max_prompts: int = Field(4, ge=1, le=4096)
    wait_s: float = Field(0.0, ge=0, le=MAX_WAIT_S)


TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=2**31)]], Field(max_length=1 << 16)]


class CompletionIn(_Req):
    prompt_ids: TokenIds
    token_ids: TokenIds
    logprobs: Annotated[list[Annotated[float, Field(le=0)]], Field(max_length=1 << 16)]
    finished: bool
    reward: float


class RolloutIn(_Req):
    rollout_id: Annotated[str, Field(min_length=3, max_length=40)]
    version: int = Field(ge=0, le=2**62)
    reward: float
    """Mean reward of the group."""
    exact_match: float = Field(ge=0, le=1)
    """Fraction of the group that is exactly right."""
    completions: list[CompletionIn] = Field(min_length=1, max_length=4096)


class SubmitReq(_Req):
    replica_id: ReplicaId
    lease_id: Annotated[str, Field(min_length=1, max_length=40)]
    rollouts: list[RolloutIn] = Field(min_length=1, max_length=4096)


class BatchLeaseReq(_Req):
    replica_id: ReplicaId
    step: int = Field(ge=0, le=2**62)
    """The replica's committed step count: the batch asked for is the one it trains next."""
    wait_s: float = Field(0.0, ge=0, le=MAX_WAIT_S)


class BatchAckReq(_Req):
    replica_id: ReplicaId
    step: int = Field(ge=1, le=2**62)
    """Committed step count after the commit."""


class SyncDoneReq(_Req):
    replica_id: ReplicaId
    seq: int = Field(ge=1, le=2**62)
    version: int = Field(ge=-1, le=2**62)
    ok: bool
    error: str = Field("", max_length=1000)


class ScaleReq(_Req):
    role: Annotated[str, Field(min_length=1, max_length=32)]
    replicas: int = Field(ge=0, le=100_000)


class CheckpointReq(_Req):
    replica_id: ReplicaId
    step: int = Field(ge=0)
    url: str = Field(min_length=1, max_length=4096)
    nbytes: int = Field(ge=0)


class FieldError(BaseModel):
    field: str
    message: str


class ErrorBody(BaseModel):
    """Every 4xx reply: what was wrong, and the field(s) at fault."""

    error: str
    fields: list[FieldError]


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in {
        401: "missing or wrong job token",
        409: "conflict with the job's state",
        410: "the replica is not a member (never registered, or evicted): register again",
        413: "request body too large",
        422: "invalid request: the fields named are wrong",
    }.items()
}


def _error(status: int, message: str, fields: list[dict[str, str]] | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "fields": fields or []}, status_code=status)


class BodyLimit:
    """ASGI middleware: refuse bodies over ``limit`` bytes with 413, whether the
    client declared a Content-Length or streamed the body."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")

        def too_big() -> JSONResponse:
            # Built only when needed: a JSONResponse per request was a measurable cost.
            return _error(
                413, f"request body must be at most {self.limit} bytes; send less per request."
            )

        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await too_big()(scope, receive, send)
        body, more = b"", True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return None
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > self.limit:
                return await too_big()(scope, receive, send)
        sent = False

        async def replay() -> dict[str, Any]:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


class AuthAndEpoch:
    """ASGI middleware: refuse a request without the job token (401) before FastAPI
    parses its body, so that an anonymous request with a malformed body gets 401,
    not 422; and stamp every reply with ``X-Phalanx-Epoch``.

    A plain ASGI class on purpose: each ``@app.middleware("http")`` costs a task
    group and memory streams per request, which was most of the controller's
    per-request CPU (see docs/benchmarks.md)."""

    def __init__(
        self,
        app: Any,
        token: bytes,
        epoch: Callable[[], int],
        unauthorized: Callable[[Request], Awaitable[Response]],
    ):
        self.app, self.token, self.epoch, self.unauthorized = app, token, epoch, unauthorized

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_epoch(msg: MutableMapping[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                headers = [*msg.get("headers", []), (b"x-phalanx-epoch", b"%d" % self.epoch())]
                msg = {**msg, "headers": headers}
            await send(msg)

        if not is_public(scope["path"]):
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, given = get_authorization_scheme_param(header.decode("latin-1"))
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), self.token):
                response = await self.unauthorized(Request(scope))
                return await response(scope, receive, send_with_epoch)
        return await self.app(scope, receive, send_with_epoch)


Handler = Callable[[Any], Awaitable[dict[str, Any] | Response]]
OnDisconnect = Callable[[Any], None]


class FastPath:
    """ASGI middleware that serves the hot long-polls (heartbeat, quorum) without
    FastAPI's routing and dependency layers: validate the body with the route's
    own pydantic model, call the route's own handler, write the JSON. Every
    request it cannot validate goes on to FastAPI unchanged, so error replies
    are exactly FastAPI's. Sits inside :class:`BodyLimit` (which hands it the
    whole body as one message) and :class:`AuthAndEpoch` (token checked, epoch
    stamped). Per request this halves the controller's CPU, which is what a
    quorum round of N replicas waits on (see docs/benchmarks.md)."""

    def __init__(
        self,
        app: Any,
        routes: dict[str, tuple[type[BaseModel], Handler, OnDisconnect | None]],
    ):
        self.app, self.routes = app, routes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        route = None
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self.routes.get(scope["path"])
        if route is None:
            return await self.app(scope, receive, send)
        msg = await receive()
        model, handler, on_disconnect = route
        try:
            req = model.model_validate_json(msg.get("body", b""))
        except ValueError:
            sent = False

            async def replay() -> dict[str, Any]:
                nonlocal sent
                if not sent:
                    sent = True
                    return msg
                return await receive()

            return await self.app(scope, replay, send)
        # While a long-poll is held, the only thing the client can send is its
        # disconnect: a replica that died (SIGKILL) drops its held heartbeat.
        watch = None
        if on_disconnect is not None:
            watch = asyncio.ensure_future(receive())
            watch.add_done_callback(
                lambda w: (
                    on_disconnect(req)
                    if not w.cancelled()
                    and w.exception() is None
                    and w.result()["type"] == "http.disconnect"
                    else None
                )
            )
        try:
            out = await handler(req)
        except StateError as exc:
            fields = [{"field": exc.field, "message": str(exc)}] if exc.field else []
            return await _error(exc.status, str(exc), fields)(scope, receive, send)
        finally:
            if watch is not None and not watch.done():
                watch.cancel()
        body = out.body if isinstance(out, Response) else _JSON.dump_json(out)
        headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


def create_app(service: ControllerService, token: str) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        service.start()
        yield
        await service.stop()

    app = FastAPI(
        title="phalanx controller",
        version=API_VERSION,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
        responses=_ERRORS,
        # No OpenTelemetry lookups per request: they cost ~8% of the CPU at N=1000.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    expected = token.encode()

    # async: a plain def dependency would hop through the thread pool on every request.
    async def auth(cred: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
        given = (cred.credentials if cred else "").encode()
        if not hmac.compare_digest(given, expected):
            raise _Unauthorized()

    authorized = Depends(auth)

    @app.exception_handler(_Unauthorized)
    async def _unauth(request: Request, exc: _Unauthorized) -> JSONResponse:
        r = _error(
            401,
            "a valid job token is required: send 'Authorization: Bearer <token>' "
            "(the token is in the state dir's 'token' file or $PHALANX_TOKEN).",
        )
        r.headers["WWW-Authenticate"] = "Bearer"
        return r

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        fields = [
            {
                "field": ".".join(str(p) for p in e["loc"] if p != "body") or "body",
                "message": e["msg"],
            }
            if e["type"] != "json_invalid"
            else {
                "field": "body",
                "message": f"{e['msg']} at character {e['loc'][-1]}: "
                f"{e.get('ctx', {}).get('error', '')}",
            }
            for e in exc.errors()
        ]
        names = ", ".join(f["field"] for f in fields)
        return _error(422, f"invalid request: check {names}", fields)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        fields = [{"field": "body", "message": str(exc.detail)}] if exc.status_code == 400 else []
        r = _error(exc.status_code, str(exc.detail), fields)
        r.headers.update(exc.headers or {})
        return r

    @app.exception_handler(StateError)
    async def _refused(request: Request, exc: StateError) -> JSONResponse:
        fields = [{"field": exc.field, "message": str(exc)}] if exc.field else []
        return _error(exc.status, str(exc), fields)

    st = service.state

    def reply(**body: Any) -> dict[str, Any]:
        return {"epoch": service.epoch, "job_id": st.cfg.job.id, **body}

    ok_replies: dict[tuple[str, int, int], bytes] = {}

    def quorum_ok(q: Quorum) -> Response:
        # Every member of a quorum gets the same reply: encode it once per quorum
        # (with the serializer FastAPI would use), not once per member. Building
        # and serializing the N-member record N times a round was O(N^2) and the
        # controller's top cost from N = 100 on (see docs/benchmarks.md).
        key = (q.role, q.round, q.quorum_id)
        body = ok_replies.get(key)
        if body is None:
            body = ok_replies[key] = _JSON.dump_json(reply(status="ok", quorum=q.record()))
            while len(ok_replies) > 4 * QUORUM_HISTORY:
                del ok_replies[next(iter(ok_replies))]
        return Response(body, media_type="application/json")

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"ok": True, "epoch": service.epoch}

    @app.get("/openapi.json", dependencies=[authorized], include_in_schema=False)
    async def openapi() -> dict[str, Any]:
        return app.openapi()

    @app.get("/metrics", dependencies=[authorized])
    async def metrics() -> Response:
        return Response(generate_latest(service.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get(f"/{API_VERSION}/status", dependencies=[authorized])
    async def status() -> dict[str, Any]:
        return reply(**st.status(service.clock(), service.wall()))

    @app.post(f"/{API_VERSION}/register", dependencies=[authorized])
    async def register(req: RegisterReq) -> dict[str, Any]:
        member = service.apply(
            st.register,
            req.role,
            req.name,
            uuid.uuid4().hex[:8],
            ranks=req.ranks,
            address=req.address,
            capabilities=req.capabilities,
        )
        t = st.cfg.timeouts
        return reply(
            replica_id=member.replica_id,
            heartbeat_interval_s=t.heartbeat_interval_s,
            heartbeat_timeout_s=t.heartbeat_s,
            suspect_grace_s=t.suspect_grace_s,
            quorum_timeout_s=t.quorum_s,
        )

    @app.post(f"/{API_VERSION}/heartbeat", dependencies=[authorized])
    async def heartbeat(req: HeartbeatReq) -> dict[str, Any]:
        healed = req.healed.model_dump() if req.healed is not None else None
        service.apply(
            st.heartbeat,
            req.replica_id,
            step=req.step,
            loss=req.loss,
            inner_step=req.inner_step,
            healed=healed,
        )
        service.metrics.heartbeats.inc()
        if healed is not None:
            service.metrics.heal_seconds.observe(healed["seconds"])
        wait = min(req.wait_s, st.cfg.timeouts.heartbeat_interval_s)
        woken = await service.wait("heartbeat", req.replica_id, wait)
        m = st.members.get(req.replica_id)
        if m is None:
            st.member(req.replica_id)  # raises 410: evicted while we waited
        return reply(probe=woken and m is not None and m.suspect_since is not None)

    @app.post(f"/{API_VERSION}/lifeline", dependencies=[authorized])
    async def lifeline(req: LifelineReq) -> dict[str, Any]:
        """Held open by a replica for as long as it lives (re-posted every ``wait_s``):
        when the connection drops with no reply, the process died, and the
        replica is suspected at once (``timeouts.suspect_on_disconnect``). Unlike
        the held heartbeat, it is held almost all the time, whatever the
        replica's heartbeat thread is doing. Ends early if the replica leaves."""
        st.member(req.replica_id)  # 410 when not a member
        await service.wait("lifeline", req.replica_id, req.wait_s)
        return reply()

    @app.post(f"/{API_VERSION}/quorum", dependencies=[authorized], response_model=dict[str, Any])
    async def quorum(req: QuorumReq) -> dict[str, Any] | Response:
        t0 = time.monotonic()
        q = service.apply(
            st.request_quorum, req.replica_id, req.step, req.request_id, req.timeout_s
        )
        deadline = t0 + req.wait_s
        while q is None:
            left = deadline - time.monotonic()
            if left <= 0 or not await service.wait("quorum", req.replica_id, left):
                break
            st.member(req.replica_id)  # raises 410 if evicted while waiting
            q = st.answer(req.replica_id, req.request_id)
        if q is None:
            return reply(status="pending", quorum=None)
        service.metrics.quorum_wait.labels(q.role).observe(time.monotonic() - t0)
        return quorum_ok(q)

    @app.post(f"/{API_VERSION}/commands/poll", dependencies=[authorized])
    async def poll(req: PollReq) -> dict[str, Any]:
        cmds = st.pending_commands(req.replica_id, req.after)
        if not cmds and await service.wait("commands", req.replica_id, req.wait_s):
            cmds = st.pending_commands(req.replica_id, req.after)
        return reply(commands=[c.__dict__ for c in cmds])

    @app.post(f"/{API_VERSION}/commands/ack", dependencies=[authorized])
    async def ack(req: AckReq) -> dict[str, Any]:
        missing = st.ack(req.replica_id, req.ids)
        service.commit()
        return reply(not_pending=missing)

    @app.post(f"/{API_VERSION}/commands", dependencies=[authorized])
    async def enqueue(req: EnqueueReq) -> dict[str, Any]:
        cmds = service.apply(st.enqueue, req.target, req.kind, req.payload)
        service.metrics.commands.labels(req.kind).inc(len(cmds))
        return reply(commands=[c.__dict__ for c in cmds])

    @app.post(f"/{API_VERSION}/report-failure", dependencies=[authorized])
    async def report_failure(req: ReportReq) -> dict[str, Any]:
        unknown = service.apply(
            st.report_failure,
            req.reporter,
            req.suspects,
            reason=req.reason,
            failed_commit=req.failed_commit,
        )
        service.metrics.reports.inc()
        return reply(unknown=unknown)

    @app.post(f"/{API_VERSION}/deregister", dependencies=[authorized])
    async def deregister(req: DeregisterReq) -> dict[str, Any]:
        service.apply(st.deregister, req.replica_id, req.reason)
        return reply(ok=True)

    async def _ledger_poll(
        rid: str,
        wait_s: float,
        call: Callable[[], dict[str, Any]],
        news: Callable[[dict[str, Any]], bool] = lambda out: False,
    ):
        """Long-poll ``call`` until its reply holds a lease or batch, a sync order or
        the job's end, or ``news``: something else the caller acts on at once."""
        deadline = time.monotonic() + wait_s
        out = call()
        while (
            out.get("batch", out.get("lease")) is None
            and not out["sync"]
            and not out["finished"]
            and not news(out)
        ):
            left = deadline - time.monotonic()
            if left <= 0 or not await service.wait("ledger", rid, left):
                break
            out = call()
        return out

    @app.post(f"/{API_VERSION}/prompts/lease", dependencies=[authorized])
    async def lease_prompts(req: PromptLeaseReq) -> dict[str, Any]:
        """Lease prompts (rollout replicas). Long-polls up to ``wait_s`` for a lease,
        a weight-sync order this replica must join, or the end of the job."""
        # A replica without weights (version -1) is answered at once when it may build
        # version 0 from the config itself: it then asks again, holding version 0.
        # (Waiting here would hold every rollout replica up for wait_s at the start.)
        out = await _ledger_poll(
            req.replica_id,
            req.wait_s,
            lambda: service.apply(st.lease_prompts, req.replica_id, req.version, req.max_prompts),
            news=lambda out: req.version < 0 and out["init_weights"],
        )
        return reply(**out)

    @app.post(f"/{API_VERSION}/rollouts/submit", dependencies=[authorized])
    async def submit_rollouts(req: SubmitReq) -> dict[str, Any]:
        """Submit a lease's rollouts. Each rollout id is recorded once: copies are
        dropped (``duplicate``), rollouts from too old weights are discarded (``stale``)."""
        rollouts = [r.model_dump() for r in req.rollouts]
        out = service.apply(st.submit_rollouts, req.replica_id, req.lease_id, rollouts)
        return reply(**out)

    @app.post(f"/{API_VERSION}/rollouts/lease", dependencies=[authorized])
    async def lease_batch(req: BatchLeaseReq) -> dict[str, Any]:
        """The frozen batch of rollouts for the policy step ``step`` (the same for every
        replica that asks for that step). Long-polls up to ``wait_s`` until it can be
        frozen, a sync order names this replica, or the job ends."""
        out = await _ledger_poll(
            req.replica_id,
            req.wait_s,
            lambda: service.apply(st.lease_batch, req.replica_id, req.step),
        )
        return reply(**out)

    @app.post(f"/{API_VERSION}/rollouts/ack", dependencies=[authorized])
    async def ack_batch(req: BatchAckReq) -> dict[str, Any]:
        """The policy committed up to ``step``: its batches are trained. Idempotent."""
        return reply(**service.apply(st.ack_batch, req.replica_id, req.step))

    @app.post(f"/{API_VERSION}/weights/done", dependencies=[authorized])
    async def sync_done(req: SyncDoneReq) -> dict[str, Any]:
        """A mesh member finished (or failed) weight sync ``seq``."""
        out = service.apply(st.sync_done, req.replica_id, req.seq, req.version, req.ok, req.error)
        return reply(**out)

    @app.post(f"/{API_VERSION}/scale", dependencies=[authorized])
    async def scale(req: ScaleReq) -> dict[str, Any]:
        """Ask for ``replicas`` replicas of ``role``; a local launcher follows it."""
        return reply(desired=service.apply(st.set_desired, req.role, req.replicas))

    @app.post(f"/{API_VERSION}/checkpoints", dependencies=[authorized])
    async def checkpoint(req: CheckpointReq) -> dict[str, Any]:
        """A replica committed a checkpoint; the status's ``checkpoints`` lists it."""
        rec = service.apply(st.record_checkpoint, req.replica_id, req.step, req.url, req.nbytes)
        return reply(checkpoint=rec)

    app.include_router(dashboard_routes(service, reply, authorized))
    from phalanx.controller.queue_api import queue_routes  # it imports this module's models

    app.include_router(queue_routes(service, reply, authorized))

    def dropped(req: HeartbeatReq | QuorumReq | LifelineReq) -> None:
        service.apply(st.suspect, req.replica_id, "held connection dropped")

    on_drop = dropped if st.cfg.timeouts.suspect_on_disconnect else None
    fast: dict[str, tuple[type[BaseModel], Handler, OnDisconnect | None]] = {
        f"/{API_VERSION}/heartbeat": (HeartbeatReq, heartbeat, on_drop),
        f"/{API_VERSION}/quorum": (QuorumReq, quorum, on_drop),
        f"/{API_VERSION}/lifeline": (LifelineReq, lifeline, on_drop),
    }
    # Added last = outermost: BodyLimit -> AuthAndEpoch -> FastPath -> FastAPI.
    app.add_middleware(FastPath, routes=fast)
    app.add_middleware(
        AuthAndEpoch,
        token=expected,
        epoch=lambda: service.epoch,
        unauthorized=lambda request: _unauth(request, _Unauthorized()),
    )
    app.add_middleware(BodyLimit, limit=st.cfg.controller.max_body_bytes)
    return app


class _Unauthorized(Exception):
    pass

"""The dashboard: a static page at ``/``, a live status stream, and operator actions.

- ``GET /`` and ``GET /dashboard/{app.js,style.css}`` are public: they hold no
  job data. The page asks for the job token once (or takes it from the URL
  fragment, ``/#token=...``, which browsers never send to the server), keeps
  it in the tab's ``sessionStorage`` and sends it as a bearer token; it never
  goes into a URL's query string.
- ``GET /v1/stream`` (token) is a server-sent-events stream of the job's
  status, the same JSON as ``GET /v1/status``: one ``status`` event at once,
  then one whenever the journal changed, at most ``STREAM_MIN_S`` apart and at
  least every ``STREAM_MAX_S`` (heartbeat ages move). The page reads it with
  ``fetch`` (``EventSource`` cannot send an ``Authorization`` header) and falls
  back to polling ``/v1/status`` every two seconds if the stream breaks.
- Actions (token; the page asks for a confirmation first): evict or drain a
  replica, trigger a checkpoint. Scaling a role is ``POST /v1/scale``.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable
from importlib.resources import files
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.params import Depends
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from phalanx.controller.service import ControllerService

STREAM_MIN_S = 0.5
"""Least time between two status events of one stream (at most 2 a second)."""
STREAM_MAX_S = 2.0
"""Most time between two status events, even when nothing was journaled."""
STATIC = {
    "app.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# The page loads nothing from elsewhere and runs no inline script.
HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def is_public(path: str) -> bool:
    """Paths served without the job token: health, and the page's static files."""
    return path in ("/healthz", "/") or (
        path.startswith("/dashboard/") and path.removeprefix("/dashboard/") in STATIC
    )


def _static(name: str) -> bytes:
    return files("phalanx.controller").joinpath("dashboard", name).read_bytes()


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class EvictReq(_Req):
    replica_id: Annotated[str, Field(min_length=1, max_length=160)]
    reason: str = Field("", max_length=200)


class DrainReq(_Req):
    replica_id: Annotated[str, Field(min_length=1, max_length=160)]


class TriggerCheckpointReq(_Req):
    lead_steps: int | None = Field(None, ge=1, le=1_000_000)
    """Checkpoint the step this many steps ahead of the job's current one (default:
    about two seconds of steps, at least 2, so every replica has polled by then)."""


def dashboard_routes(
    service: ControllerService, reply: Callable[..., dict[str, Any]], authorized: Depends
) -> APIRouter:
    router = APIRouter()
    st = service.state
    page = _static("index.html")

    @router.get("/", include_in_schema=False)
    async def index() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=HEADERS)

    @router.get("/dashboard/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in STATIC:
            return Response(status_code=404)
        return Response(_static(name), media_type=STATIC[name], headers=HEADERS)

    def status_event() -> bytes:
        body = reply(**st.status(service.clock(), service.wall()))
        return b"event: status\ndata: " + json.dumps(body).encode() + b"\n\n"

    # Not in the OpenAPI spec: an endless stream is no use to generated clients or
    # fuzzers. tests/integration/test_dashboard_api.py checks its token and format.
    @router.get("/v1/stream", dependencies=[authorized], include_in_schema=False)
    async def stream(
        request: Request,
        max_events: Annotated[int, Query(ge=1, le=1_000_000)] = 1_000_000,
    ) -> StreamingResponse:
        """Server-sent events: the job's status (as ``GET /v1/status``) whenever it
        changes, at most twice a second and at least every two seconds.
        ``max_events`` ends the stream after that many events."""
        key = f"stream-{uuid.uuid4().hex}"

        async def events() -> AsyncIterator[bytes]:
            loop = asyncio.get_running_loop()
            for i in range(max_events):
                if i:
                    t0 = loop.time()
                    await service.wait("status", key, STREAM_MAX_S)
                    await asyncio.sleep(max(0.0, STREAM_MIN_S - (loop.time() - t0)))
                    if await request.is_disconnected():
                        return
                yield status_event()

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    @router.post("/v1/replicas/evict", dependencies=[authorized])
    async def evict(req: EvictReq) -> dict[str, Any]:
        """Evict a replica now. A live process registers again as a new incarnation."""
        service.apply(st.evict_replica, req.replica_id, req.reason)
        return reply(evicted=req.replica_id)

    @router.post("/v1/replicas/drain", dependencies=[authorized])
    async def drain(req: DrainReq) -> dict[str, Any]:
        """Queue a ``drain`` command: the replica leaves at its next step boundary."""
        cmds = service.apply(st.drain_replica, req.replica_id)
        service.metrics.commands.labels("drain").inc(len(cmds))
        return reply(commands=[c.__dict__ for c in cmds])

    @router.post("/v1/checkpoints/trigger", dependencies=[authorized])
    async def trigger_checkpoint(req: TriggerCheckpointReq) -> dict[str, Any]:
        """Ask the policy replicas to checkpoint a step a little ahead (a ``checkpoint``
        command, honoured by FT-DDP replicas with ``[checkpoint] url`` set)."""
        lead = req.lead_steps
        if lead is None and "policy" in st.roles:
            from phalanx.controller.overview import steps_per_s

            lead = max(2, round(2 * steps_per_s(st.roles["policy"], service.clock())))
        cmds = service.apply(st.request_checkpoint, lead or 2)
        service.metrics.commands.labels("checkpoint").inc(len(cmds))
        return reply(step=cmds[0].payload["step"] if cmds else None, replicas=len(cmds))

    return router

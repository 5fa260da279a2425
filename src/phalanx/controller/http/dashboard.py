"""The dashboard: a static page at ``/`` and a live status stream.

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
- The page's actions (evict, drain, checkpoint, scale) are the operator routes
  of :mod:`~phalanx.controller.http.commands`.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from importlib.resources import files
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi.params import Depends
from starlette.responses import Response, StreamingResponse

from phalanx.controller.http.base import Api, encode

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


def dashboard_routes(api: Api, authorized: Depends) -> APIRouter:
    router = APIRouter()
    page = _static("index.html")
    svc = api.service

    @router.get("/", include_in_schema=False)
    async def index() -> Response:
        return Response(page, media_type="text/html; charset=utf-8", headers=HEADERS)

    @router.get("/dashboard/{name}", include_in_schema=False)
    async def static(name: str) -> Response:
        if name not in STATIC:
            return Response(status_code=404)
        return Response(_static(name), media_type=STATIC[name], headers=HEADERS)

    def status_event() -> bytes:
        return b"event: status\ndata: " + encode(svc.status()) + b"\n\n"

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
                    await svc.wait("status", key, STREAM_MAX_S)
                    await asyncio.sleep(max(0.0, STREAM_MIN_S - (loop.time() - t0)))
                    if await request.is_disconnected():
                        return
                yield status_event()

        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(events(), media_type="text/event-stream", headers=headers)

    return router

"""The controller's ASGI middleware, outermost first: FastAPI's error middleware ->
:class:`AuthAndEpoch` -> :class:`BodyLimit` -> FastAPI's routing. (The hot routes
are mostly answered before ASGI: :mod:`phalanx.controller.http.hot`.)

Plain ASGI classes on purpose: each ``@app.middleware("http")`` costs a task
group and memory streams per request, which was most of the controller's
per-request CPU (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import Request
from fastapi.security.utils import get_authorization_scheme_param
from starlette.responses import JSONResponse, Response

from phalanx.controller.http.errors import error


class BodyLimit:
    """Refuse bodies over ``limit`` bytes with 413, whether the client declared a
    Content-Length or streamed the body, and bodies that do not arrive within
    ``timeout_s`` with 408. Sits inside :class:`AuthAndEpoch`: only a request with
    the job token gets its body read at all."""

    def __init__(self, app: Any, limit: int, timeout_s: float = 10.0):
        self.app, self.limit, self.timeout_s = app, limit, timeout_s

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")

        def too_big() -> JSONResponse:
            # Built only when needed: a JSONResponse per request was a measurable cost.
            return error(
                413, f"request body must be at most {self.limit} bytes; send less per request."
            )

        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            return await too_big()(scope, receive, send)
        body, more = b"", True
        deadline = asyncio.get_running_loop().time() + self.timeout_s
        while more:
            left = deadline - asyncio.get_running_loop().time()
            try:
                msg = await asyncio.wait_for(receive(), max(left, 0.0))
            except TimeoutError:
                slow = error(
                    408,
                    f"request body must arrive within {self.timeout_s:g} s "
                    f"(controller.body_timeout_s): got {len(body)} bytes by then.",
                )
                slow.headers["Connection"] = "close"
                return await slow(scope, receive, send)
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
    """Refuse a request without the job token (401) before its body is even read:
    an anonymous client can hold no memory with a large or stalled body, and one
    with a malformed body gets 401, not 422. Stamp every reply with
    ``X-Phalanx-Epoch``."""

    def __init__(
        self,
        app: Any,
        token: bytes,
        epoch: Callable[[], int],
        unauthorized: Callable[[Request], Awaitable[Response]],
        is_public: Callable[[str], bool],
    ):
        self.app, self.token, self.epoch, self.unauthorized = app, token, epoch, unauthorized
        self.is_public = is_public

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_epoch(msg: MutableMapping[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                headers = [*msg.get("headers", []), (b"x-phalanx-epoch", b"%d" % self.epoch())]
                msg = {**msg, "headers": headers}
            await send(msg)

        if not self.is_public(scope["path"]):
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, given = get_authorization_scheme_param(header.decode("latin-1"))
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), self.token):
                response = await self.unauthorized(Request(scope))
                # The body is never read: the connection cannot be reused for another
                # request, so it is closed with this reply.
                response.headers["Connection"] = "close"
                return await response(scope, receive, send_with_epoch)
        return await self.app(scope, receive, send_with_epoch)

"""The controller's ASGI middleware, outermost first: :class:`FastPath` (the hot
routes, served whole) -> FastAPI's error middleware -> :class:`AuthAndEpoch` ->
:class:`BodyLimit` -> FastAPI's routing.

Plain ASGI classes on purpose: each ``@app.middleware("http")`` costs a task
group and memory streams per request, which was most of the controller's
per-request CPU (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, cast

from fastapi import Request
from fastapi.security.utils import get_authorization_scheme_param
from pydantic import ValidationError
from starlette.responses import JSONResponse, Response

from phalanx.controller.core.base import StateError
from phalanx.controller.http.base import Api, Route, encode
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


OnDisconnect = Callable[[Any], None]

BODY_WAIT_S = 1.0
"""How long :class:`FastPath` waits for a hot request's body before it hands the
request to the full app (whose :class:`BodyLimit` times it out)."""


def _replay(msg: dict[str, Any], receive: Any) -> Any:
    """A ``receive`` that gives ``msg`` (already read) first."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return msg
        return await receive()

    return replay


class DisconnectWatch:
    """Calls ``on_drop`` if the client drops the connection while its request is
    held (the server's ``receive`` then answers ``http.disconnect``), until
    :meth:`close`.

    It drives ``receive()`` by hand, the way a task would (a step, then a done
    callback on the future it waits on) but without one: a task per held request
    (every held heartbeat, 10,000 a second at N = 10,000) cost more than the rest of
    the request. A ``receive`` that waits on anything but an asyncio future or a bare
    yield is not watched."""

    def __init__(self, receive: Any, on_drop: Callable[[], None]):
        self.on_drop = on_drop
        self.coro = receive()
        self.waiting_on: asyncio.Future[Any] | None = None
        self.closed = False
        self._step()

    def _step(self, _: object = None) -> None:
        self.waiting_on = None
        if self.closed:
            return
        try:
            awaited = self.coro.send(None)
        except StopIteration as stop:
            self.closed = True
            if isinstance(stop.value, dict) and stop.value.get("type") == "http.disconnect":
                self.on_drop()
            return
        except Exception:  # the server's receive failed: nothing left to watch
            self.closed = True
            return
        if isinstance(awaited, asyncio.Future):
            awaited._asyncio_future_blocking = False  # as a task does: it took the future
            self.waiting_on = awaited
            awaited.add_done_callback(self._step)
        elif awaited is None:  # a bare yield (asyncio.sleep(0)): step again soon
            asyncio.get_running_loop().call_soon(self._step)
        else:
            self.close()

    def close(self) -> None:
        if self.waiting_on is not None:
            self.waiting_on.remove_done_callback(self._step)
            self.waiting_on = None
        if not self.closed:
            self.closed = True
            self.coro.close()


class FastPath:
    """Serve the hot routes (heartbeat, quorum, its members, lifeline) before
    anything else. Outermost, so that a well-formed request with the job token
    skips all of FastAPI's stack (its error middleware, routing, dependencies), the
    epoch middleware's send wrapper and the body limit's read task: it validates the
    body with the route's own request model, calls the route's own handler and
    writes its reply, with the epoch header. At N = 10,000 replicas these routes
    are 20,000 requests a second, and what each costs is what a quorum round waits
    on (docs/benchmarks.md, "Controller").

    Every other request, and every hot one it cannot serve as is (no or another
    token, a body declared too large, late, or not valid), goes to the full app
    unchanged, so every error reply is exactly the full app's."""

    def __init__(
        self,
        app: Any,
        api: Api,
        routes: list[Route],
        token: bytes,
        limit: int,
        on_disconnect: OnDisconnect | None,
    ):
        self.app, self.api, self.on_disconnect = app, api, on_disconnect
        self.routes = {r.path: r for r in routes}
        self.auth, self.limit = b"Bearer " + token, limit

    def _servable(self, scope: dict[str, Any]) -> bool:
        """The request carries the job token and declares no body over the limit."""
        auth, length = b"", None
        for k, v in scope["headers"]:
            if k == b"authorization":
                auth = auth or v
            elif k == b"content-length":
                length = v
        if length is not None and (not length.isdigit() or int(length) > self.limit):
            return False
        return hmac.compare_digest(auth, self.auth)

    async def _body(self, receive: Any) -> dict[str, Any] | None:
        """The first message of the body, or None if it does not come within
        :data:`BODY_WAIT_S`. The body has almost always arrived with the headers: then
        one step of ``receive()`` returns it, with no timer at all (a timer, or
        ``asyncio.timeout``, was a tenth of a heartbeat's cost)."""
        pending = receive()
        if inspect.iscoroutine(pending):
            try:
                pending.send(None)
            except StopIteration as done:
                return cast(dict[str, Any], done.value)
            pending.close()  # it waits for the body: wait again, with a deadline
            pending = receive()
        task = asyncio.current_task()
        if task is None:  # not in a task (no server runs the app that way)
            return cast(dict[str, Any], await pending)
        late = False

        def too_late() -> None:
            nonlocal late
            late = True
            task.cancel()

        timer = asyncio.get_running_loop().call_later(BODY_WAIT_S, too_late)
        try:
            return cast(dict[str, Any], await pending)
        except asyncio.CancelledError:
            if not late:
                raise
            task.uncancel()
            return None
        finally:
            timer.cancel()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        route = None
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self.routes.get(scope["path"])
        if route is None or not self._servable(scope):
            return await self.app(scope, receive, send)
        msg = await self._body(receive)
        if msg is None:  # late: the full app's BodyLimit times it out
            return await self.app(scope, receive, send)
        body = msg.get("body", b"")
        if msg["type"] != "http.request" or msg.get("more_body") or len(body) > self.limit:
            return await self.app(scope, _replay(msg, receive), send)
        try:
            req = route.request.model_validate_json(body)
        except ValidationError:
            return await self.app(scope, _replay(msg, receive), send)
        # While a long-poll is held, the only thing the client can send is its
        # disconnect: a replica that died (SIGKILL) drops its held request.
        watch = None
        on_disconnect = self.on_disconnect if route.held else None
        if on_disconnect is not None and getattr(req, "wait_s", 1.0) > 0:
            watch = DisconnectWatch(receive, lambda: on_disconnect(req))
        try:
            out = await route.handler(self.api, req)
        except StateError as exc:
            fields = [{"field": exc.field, "message": str(exc)}] if exc.field else []
            response = error(exc.status, str(exc), fields)
            response.headers["x-phalanx-epoch"] = str(self.api.service.epoch)
            return await response(scope, receive, send)
        finally:
            if watch is not None:
                watch.close()
        if isinstance(out, bytes):
            body = out
        else:
            body = bytes(out.body) if isinstance(out, Response) else encode(out)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            (b"x-phalanx-epoch", b"%d" % self.api.service.epoch),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})

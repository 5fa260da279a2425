"""The hot routes (heartbeat, quorum, its members, lifeline), answered inside the
HTTP server's protocol: no ASGI scope, no task, one write per reply.

At N = 10,000 replicas these routes are some 20,000 requests a second (a 1 Hz
heartbeat each, and a round's quorum requests), and what each costs is what a
quorum round waits on (docs/benchmarks.md, "Controller"). uvicorn spends about
28 us of CPU on a request before the app sees it (its scope, a task, a request
cycle, two writes); a protocol that parses with the same httptools parser and
writes its reply at once spends 5. So the controller's server runs
:class:`HotProtocol`, uvicorn's own HTTP protocol with one change: a request it
recognizes as hot, and can answer as is, it answers itself, calling the route's
own handler (:mod:`phalanx.controller.http.membership`) with the route's own
request model. Everything else, and any hot request it cannot answer as is (no
or another token, a body declared too large, late or not valid, a request
pipelined behind another), goes through uvicorn to the full app unchanged, so
every error reply is exactly the full app's.

A handler is a coroutine: :class:`Driven` runs it without a task (a step, then a
done callback on the future it waits on), and a held request whose connection
drops (a replica that died) is suspected at once, as a long-poll's disconnect
is (``timeouts.suspect_on_disconnect``).

This relies on uvicorn's ``HttpToolsProtocol`` (its parser callbacks and
``cycle``/``pipeline`` bookkeeping) as of the pinned uvicorn 0.54.0:
:func:`hot_protocol` returns None, and the server runs plain uvicorn, where that
class is not the one this was written against.
"""

from __future__ import annotations

import asyncio
import hmac
import http
import json
import logging
from collections.abc import Callable, Coroutine
from typing import Any, cast

from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from phalanx.controller.core.base import StateError
from phalanx.controller.http.base import Api, Route, encode

log = logging.getLogger("phalanx.controller")

BODY_WAIT_S = 1.0
"""How long a hot request's body may take after its headers before the request is
handed to uvicorn (whose app times it out: ``controller.body_timeout_s``)."""

OnDisconnect = Callable[[Any], None]


def _status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return f"HTTP/1.1 {status} {phrase}\r\n".encode()


class Driven:
    """Runs coroutine ``coro`` to its end the way a task would, without one: a step,
    then a done callback on the asyncio future it waits on. Calls ``done(result)``
    or ``failed(error)``, once, unless :meth:`cancel` came first. (A task per held
    request, 10,000 a second at N = 10,000, cost more than the rest of the request.)
    ``coro`` must wait on asyncio futures only (or yield bare, as ``sleep(0)``)."""

    def __init__(
        self,
        coro: Coroutine[Any, Any, Any],
        done: Callable[[Any], None],
        failed: Callable[[Exception], None],
    ):
        self.coro, self.done, self.failed = coro, done, failed
        self.waiting_on: asyncio.Future[Any] | None = None
        self.over = False
        self._step()

    def _step(self, _: object = None) -> None:
        self.waiting_on = None
        if self.over:
            return
        try:
            awaited = self.coro.send(None)
        except StopIteration as stop:
            self.over = True
            self.done(stop.value)
            return
        except Exception as e:
            self.over = True
            self.failed(e)
            return
        if isinstance(awaited, asyncio.Future):
            awaited._asyncio_future_blocking = False  # as a task does: it took the future
            self.waiting_on = awaited
            awaited.add_done_callback(self._step)
        elif awaited is None:  # a bare yield: step again soon
            asyncio.get_running_loop().call_soon(self._step)
        else:
            self.cancel()
            self.failed(RuntimeError(f"a hot route must await asyncio futures: got {awaited!r}"))

    def cancel(self) -> None:
        if self.waiting_on is not None:
            self.waiting_on.remove_done_callback(self._step)
            self.waiting_on = None
        if not self.over:
            self.over = True
            self.coro.close()


class _Event:
    def set(self) -> None:
        pass


class HotCycle:
    """A hot request in flight, in the place of uvicorn's request cycle
    (``protocol.cycle``): a request pipelined behind it waits in uvicorn's pipeline,
    and the server's shutdown ends the connection after its reply."""

    message_event = _Event()

    def __init__(self, protocol: Any, route: Route, req: BaseModel, keep_alive: bool):
        self.protocol, self.route, self.req, self.keep_alive = protocol, route, req, keep_alive
        self.response_complete = False
        self.disconnected = False
        self.driven: Driven | None = None

    def done(self, out: BaseModel | Response | bytes) -> None:
        self.protocol.reply(self, 200, _body_of(out))

    def failed(self, e: Exception) -> None:
        if isinstance(e, StateError):
            fields = [{"field": e.field, "message": str(e)}] if e.field else []
            self.protocol.reply(self, e.status, _json({"error": str(e), "fields": fields}))
            return
        log.error("hot route %s failed", self.route.path, exc_info=e)
        self.keep_alive = False
        self.protocol.reply(self, 500, _json({"error": "Internal Server Error", "fields": []}))


def _unfenced() -> str:
    return ""


class Hot:
    """What the hot protocol needs of the controller (one per server).

    A controller on etcd starts :meth:`unarmed` (a standby: no hot route, every
    request goes to the standby switch, which answers 421) and is :meth:`arm`-ed when
    it takes office, with the leader's fence: a request that arrives while the fence
    is up, or a reply that would leave while it is, gets the switch's 503."""

    def __init__(
        self,
        api: Api | None,
        routes: list[Route],
        token: bytes,
        limit: int,
        on_disconnect: OnDisconnect | None,
    ):
        self.api, self.on_disconnect = cast(Api, api), on_disconnect
        self.routes = {r.path.encode(): r for r in routes}
        self.auth, self.limit = b"Bearer " + token, limit
        self.fence: Callable[[], str] = _unfenced
        """Why this controller may not answer now ('' while it may)."""

    @classmethod
    def unarmed(cls) -> Hot:
        """No hot route until :meth:`arm`."""
        return cls(None, [], b"", 0, None)

    def arm(self, built: Hot, fence: Callable[[], str]) -> None:
        """Answer ``built``'s routes from now on (those of the service just built),
        behind ``fence``."""
        self.api, self.on_disconnect = built.api, built.on_disconnect
        self.auth, self.limit, self.fence = built.auth, built.limit, fence
        self.routes = built.routes


async def _answered(route: Route, api: Api, req: BaseModel) -> Any:
    """The route's reply, once the journal holds every change made before it (as the
    full app's endpoint: :meth:`Outbox.acknowledged`, 503 while it cannot)."""
    out = await route.handler(api, req)
    await api.service.acknowledged()
    return out


def hot_protocol(hot: Hot) -> type[asyncio.Protocol] | None:
    """uvicorn's HTTP protocol with ``hot``'s routes answered in it (the ``http`` of
    its config), or None where uvicorn's protocol is not the one this was written
    against (the server then runs uvicorn's own)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None
    needed = (
        *("on_message_begin", "on_headers_complete", "on_body", "on_message_complete"),
        *("on_response_complete", "connection_lost", "_unset_keepalive_if_required"),
    )
    if not all(hasattr(HttpToolsProtocol, name) for name in needed):
        log.warning("uvicorn's HTTP protocol is not the one expected: hot routes go through ASGI")
        return None

    class HotProtocol(HttpToolsProtocol):  # type: ignore[misc]
        """See the module docstring."""

        _candidate: Route | None = None
        """The hot route of the request being parsed, until it is answered or handed
        to uvicorn."""
        _body = b""
        _late: asyncio.TimerHandle | None = None
        _inflight: HotCycle | None = None
        """The hot request being answered (a held one waits)."""

        def on_message_begin(self) -> None:
            # uvicorn's scope (a dict, a copy of the app state) is built only for a
            # request that goes to uvicorn after all (:meth:`_to_uvicorn`).
            self.url = b""
            self.expect_100_continue = False
            self.headers = []
            self._candidate = None
            self._body = b""
            self._late = None

        def _to_uvicorn(self) -> None:
            """Hand the request parsed so far to uvicorn, as if it had parsed it."""
            url, headers, expect = self.url, self.headers, self.expect_100_continue
            super().on_message_begin()
            self.url, self.headers, self.expect_100_continue = url, headers, expect
            self.scope["headers"] = headers

        def on_headers_complete(self) -> None:
            route = self._hot_route()
            if route is None:
                self._to_uvicorn()
                super().on_headers_complete()
            else:
                self._candidate = route  # answered once its body is in (or handed over)

        def _hot_route(self) -> Route | None:
            route = hot.routes.get(self.url)
            if (
                route is None
                or self.parser.get_method() != b"POST"
                or self.expect_100_continue
                or self.parser.should_upgrade()
                or not (self.cycle is None or self.cycle.response_complete)
                or self.pipeline
            ):
                return None
            limit = self.limit_concurrency
            if limit is not None and len(self.connections) >= limit:
                return None  # uvicorn answers 503
            auth, length = b"", None
            for name, value in self.headers:
                if name == b"authorization":
                    auth = auth or value
                elif name == b"content-length":
                    length = value
            if length is None or not length.isdigit() or int(length) > hot.limit:
                return None
            return route if hmac.compare_digest(auth, hot.auth) else None

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._candidate is not None and self._late is None:
                # Headers in, body not yet (rare: a body sent apart, or stalled).
                self._late = self.loop.call_later(BODY_WAIT_S, self._body_late)

        def _body_late(self) -> None:
            if self._candidate is None:
                return
            self._candidate = None
            self._to_uvicorn()
            super().on_headers_complete()
            if self._body:
                super().on_body(self._body)

        def on_body(self, body: bytes) -> None:
            if self._candidate is None:
                super().on_body(body)
            else:
                self._body += body

        def on_message_complete(self) -> None:
            route = self._candidate
            if route is None:
                super().on_message_complete()
                return
            self._candidate = None
            if self._late is not None:
                self._late.cancel()
            try:
                req = route.request.model_validate_json(self._body)
            except ValidationError:  # the full app says what is wrong, as ever
                self._to_uvicorn()
                super().on_headers_complete()
                super().on_body(self._body)
                super().on_message_complete()
                return
            cycle = HotCycle(self, route, req, self.parser.should_keep_alive())
            self.cycle = self._inflight = cycle  # type: ignore[assignment]
            why = hot.fence()
            if why:  # a leader fenced (its lease in doubt, or deposed): the switch's 503
                self.reply(cycle, 503, _json({"error": why, "fields": []}))
                return
            cycle.driven = Driven(
                cast(Coroutine[Any, Any, Any], _answered(route, hot.api, req)),
                cycle.done,
                cycle.failed,
            )

        def reply(self, cycle: HotCycle, status: int, body: bytes) -> None:
            """Write ``cycle``'s reply (called by the cycle, once)."""
            cycle.response_complete = True
            if self.transport.is_closing():
                return
            if status < 500:
                late = hot.fence()  # fenced while the request was held: not sent
                if late:
                    status, body = 503, _json({"error": late, "fields": []})
            head = b"%scontent-type: application/json\r\ncontent-length: %d\r\n" % (
                _STATUS.get(status) or _status_line(status),
                len(body),
            )
            epoch = b"x-phalanx-epoch: %d\r\n" % hot.api.service.epoch
            close = b"" if cycle.keep_alive else b"connection: close\r\n"
            self.transport.write(b"".join((head, epoch, close, b"\r\n", body)))
            if not cycle.keep_alive:
                self.transport.close()
            else:
                self.on_response_complete()  # uvicorn's: pipelined requests, keep-alive

        def connection_lost(self, exc: Exception | None) -> None:
            cycle = self._inflight
            if self._late is not None:
                self._late.cancel()
            if cycle is not None and not cycle.response_complete:
                cycle.response_complete = True
                if cycle.driven is not None:
                    cycle.driven.cancel()
                # A long-poll's dropped connection says its replica died.
                wait = getattr(cycle.req, "wait_s", 0.0)
                if hot.on_disconnect is not None and cycle.route.held and wait > 0:
                    hot.on_disconnect(cycle.req)
            super().connection_lost(exc)

    return HotProtocol


_STATUS = {s: _status_line(s) for s in (200, 400, 404, 409, 410, 422, 500, 503)}


def _json(value: Any) -> bytes:
    # As starlette's JSONResponse renders the full app's error replies.
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


def _body_of(out: BaseModel | Response | bytes) -> bytes:
    if isinstance(out, bytes):
        return out
    if isinstance(out, Response):
        return bytes(out.body)
    return encode(out)

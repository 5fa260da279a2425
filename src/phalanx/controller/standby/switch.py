"""One socket, one URL, for a controller that begins as a standby and may lead.

:class:`Switch` is the ASGI app uvicorn serves for every controller of an etcd
journal. Until :meth:`Switch.lead` is called it answers as a standby: ``/healthz``
says so (and names the leader), and every other request gets 421 with
``ErrorBody.leader``, which the client follows (:mod:`phalanx.client.transport`).
Once it leads it runs the leader's app (:func:`phalanx.controller.http.create_app`),
its lifespan included, behind the **read fence**: while ``fence()`` names a reason
(no lease refresh acknowledged for a while, or deposed: :meth:`Leadership.fenced`),
every request but the status and health reads gets 503 with that reason, and so
does a reply whose headers had not left when the fence rose (a long-poll answered
after a SIGCONT). A reply that carried an effect was journaled first, under the
leader key's fence, so the fence here matters for the replies that write nothing
(heartbeats, reads): no controller that may have been replaced answers them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from phalanx.protocol.base import API_VERSION, ErrorBody, Health

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]

DASHBOARD = {"/dashboard/app.js", "/dashboard/style.css"}
"""The dashboard's files besides ``/``: a standby redirects them to the leader's."""
UNFENCED = {"/healthz", f"/{API_VERSION}/status", "/metrics"}
"""Read-only routes a fenced leader still answers (the status says why it is fenced)."""


async def _reply(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class Lifespan:
    """Runs an ASGI app's lifespan (startup, later shutdown) by hand: the app is
    switched to after uvicorn ran the outer app's own startup."""

    def __init__(self, app: App):
        self.app = app
        self._in: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._out: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def _send(self, msg: dict[str, Any]) -> None:
        await self._out.put(msg)

    async def startup(self) -> None:
        """Start the app; raises RuntimeError with its message if its startup failed."""
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}

        async def run() -> None:
            await self.app(scope, self._in.get, self._send)

        self._task = asyncio.get_running_loop().create_task(run())
        await self._in.put({"type": "lifespan.startup"})
        msg = await self._out.get()
        if msg["type"] != "lifespan.startup.complete":
            raise RuntimeError(msg.get("message", "the leader's app failed to start"))

    async def shutdown(self) -> None:
        if self._task is None:
            return
        await self._in.put({"type": "lifespan.shutdown"})
        await self._out.get()
        await self._task


class Switch:
    """The ASGI app of a controller of an etcd journal (see the module docstring).
    Called by uvicorn; :meth:`lead` and :attr:`leader_url` are set by the standby's
    loop (:mod:`phalanx.controller.standby.member`), on the same event loop."""

    def __init__(
        self,
        url: str,
        job_id: str,
        on_startup: Callable[[], Awaitable[None]],
        on_shutdown: Callable[[], Awaitable[None]],
    ):
        self.url, self.job_id = url, job_id
        self.on_startup, self.on_shutdown = on_startup, on_shutdown
        self.leader_url = ""
        """The leader's URL as last seen ('' during an election)."""
        self.app: App | None = None
        self.fence: Callable[[], str] = lambda: ""
        self._lifespan: Lifespan | None = None
        self.on_lead: Callable[[Callable[[], str]], None] | None = None
        """Called with the fence once the leader's app serves (the server arms its
        hot routes: :class:`phalanx.controller.http.hot.Hot`)."""

    async def lead(self, app: App, fence: Callable[[], str]) -> None:
        """Serve ``app`` from now on (its startup run first), behind ``fence``."""
        life = Lifespan(app)
        await life.startup()
        self._lifespan, self.fence, self.app = life, fence, app
        if self.on_lead is not None:
            self.on_lead(fence)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan_loop(receive, send)
        elif self.app is None:
            await self._standby(scope, send)
        else:
            await self._leader(self.app, scope, receive, send)

    async def _lifespan_loop(self, receive: Receive, send: Send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await self.on_startup()
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                if self._lifespan is not None:
                    await self._lifespan.shutdown()
                await self.on_shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _standby(self, scope: Scope, send: Send) -> None:
        if scope["type"] != "http":
            return  # a websocket: closed unanswered
        leader = self.leader_url
        if scope.get("path") == "/healthz":
            health = Health(ok=True, epoch=0, role="standby", leader=leader)
            await _reply(send, 200, health.model_dump_json().encode())
            return
        path = str(scope.get("path", ""))
        if leader and scope.get("method") == "GET" and (path == "/" or path in DASHBOARD):
            # A browser that opened a standby's dashboard is sent to the leader's (the
            # token, in the URL's fragment, goes along: browsers keep it across a redirect).
            location = (leader.rstrip("/") + path).encode()
            headers = [(b"location", location), (b"content-length", b"0")]
            await send({"type": "http.response.start", "status": 307, "headers": headers})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        where = f"the leader is at {leader}" if leader else "an election is under way"
        error = (
            f"the controller at {self.url} is a standby of job {self.job_id!r}: {where}. "
            f"Send requests to the leader (clients given every controller's URL do)"
        )
        await _reply(send, 421, ErrorBody(error=error, leader=leader).model_dump_json().encode())

    async def _leader(self, app: App, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in UNFENCED:
            await app(scope, receive, send)
            return
        why = self.fence()
        if why:
            await _reply(send, 503, ErrorBody(error=why).model_dump_json().encode())
            return
        replaced = False

        async def fenced_send(msg: dict[str, Any]) -> None:
            nonlocal replaced
            if msg["type"] == "http.response.start" and msg.get("status", 200) < 500:
                late = self.fence()  # a 503 already (the journal's own reason) stays
                if late:
                    replaced = True
                    await _reply(send, 503, ErrorBody(error=late).model_dump_json().encode())
                    return
            if replaced:
                return  # the body of the reply the fence replaced
            await send(msg)

        await app(scope, receive, fenced_send)

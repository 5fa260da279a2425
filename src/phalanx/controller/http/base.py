"""What the HTTP routes share: the context they are called with, the route table's
entry, and the reply encoding.

A route is a plain ``async def route(api: Api, req: SomeReq) -> SomeReply``:
it validates nothing itself (the request model did), calls the core through
``api.service.apply`` and builds its reply from :mod:`phalanx.protocol`.
:func:`phalanx.controller.http.create_app` binds every :class:`Route` to
FastAPI; the hottest ones are also answered by the server's HTTP protocol
itself (:mod:`phalanx.controller.http.hot`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel
from starlette.responses import Response

from phalanx.controller.core.state import ControllerState
from phalanx.controller.http.rosters import Rosters
from phalanx.controller.service import ControllerService


@dataclass
class Api:
    """The context every route is called with."""

    service: ControllerService
    rosters: Rosters = field(init=False)
    """Quorum replies and member lists, encoded once per round and per quorum."""

    fixed: dict[Any, bytes] = field(default_factory=dict)
    """Encoded replies that never change in a controller's life (its epoch is fixed),
    by key: built once, served as bytes (:meth:`once`)."""

    def __post_init__(self) -> None:
        self.rosters = Rosters(self.service.envelope, encode)

    def once(self, key: Any, build: Callable[[], BaseModel]) -> bytes:
        """The encoded reply ``build()`` makes, built at the first call for ``key``."""
        body = self.fixed.get(key)
        if body is None:
            body = self.fixed[key] = encode(build())
        return body

    @property
    def state(self) -> ControllerState:
        return self.service.state

    def envelope(self) -> dict[str, Any]:
        return self.service.envelope()


Handler = Callable[[Api, Any], Awaitable[BaseModel | Response | bytes]]
"""A route: the reply model, or its JSON already encoded (a Response, or bytes)."""


@dataclass(frozen=True)
class Route:
    path: str
    handler: Handler
    request: type[BaseModel]
    reply: type[BaseModel]
    held: bool = False
    """A long-poll whose dropped connection says its replica died (the hot protocol
    watches it: ``timeouts.suspect_on_disconnect``)."""


def encode(reply: BaseModel) -> bytes:
    return reply.__pydantic_serializer__.to_json(reply)


def json_response(reply: BaseModel | Response | bytes) -> Response:
    if isinstance(reply, Response):
        return reply
    body = reply if isinstance(reply, bytes) else encode(reply)
    return Response(body, media_type="application/json")

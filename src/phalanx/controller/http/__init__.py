"""The controller's HTTP API (FastAPI): versioned JSON under ``/v1``.

Every endpoint but ``/healthz`` and the dashboard's static files (``/``,
``/dashboard/*``, which hold no job data) needs the job token as a bearer
token. Requests and replies are the models of :mod:`phalanx.protocol`, and
the OpenAPI spec (``GET /openapi.json``) is generated from them. Rejected
input gets a 4xx :class:`~phalanx.protocol.base.ErrorBody` that names the
field, and never changes state (the core validates before it mutates).
Every reply carries the controller epoch, in the body and in the
``X-Phalanx-Epoch`` header, so a replica can tell that the controller
restarted.

The routes are plain functions, one module per part of the API:
``membership.py``, ``commands.py``, ``rl.py``, and
``dashboard.py`` (the page and its stream); this module binds them.
"""

from __future__ import annotations

import hmac
import inspect
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from phalanx.controller.http import commands, errors, membership, rl
from phalanx.controller.http.base import Api, Route, json_response
from phalanx.controller.http.dashboard import dashboard_routes, is_public
from phalanx.controller.http.hot import Hot
from phalanx.controller.http.middleware import AuthAndEpoch, BodyLimit
from phalanx.controller.service import ControllerService
from phalanx.protocol.base import API_VERSION, Health
from phalanx.protocol.status import Status

ROUTES: list[Route] = [*membership.ROUTES, *commands.ROUTES, *rl.ROUTES]

_bearer = HTTPBearer(auto_error=False)


def _endpoint(api: Api, route: Route) -> Any:
    """A FastAPI endpoint for ``route``: FastAPI parses the body into the route's
    request model (and documents it); the route's reply is written as is."""

    async def endpoint(req: Any) -> Response:
        reply = await route.handler(api, req)
        await api.service.acknowledged()  # waits for the journal; 503 while it is unavailable
        return json_response(reply)

    endpoint.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("req", inspect.Parameter.KEYWORD_ONLY, annotation=route.request)]
    )
    endpoint.__name__ = route.handler.__name__
    endpoint.__doc__ = route.handler.__doc__
    return endpoint


def create_app(service: ControllerService, token: str) -> FastAPI:
    """The controller's API as a FastAPI app (its OpenAPI spec, every route)."""
    return _build(service, token)[0]


def create_served(service: ControllerService, token: str) -> tuple[FastAPI, Hot]:
    """What the server serves: the API, and its hot routes, which the server's HTTP
    protocol answers itself when it can (:func:`phalanx.controller.http.hot.hot_protocol`)."""
    return _build(service, token)


def _build(service: ControllerService, token: str) -> tuple[FastAPI, Hot]:
    api = Api(service)

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
        responses=errors.ERRORS,
        # No OpenTelemetry lookups per request: they cost ~8% of the CPU at N=1000.
        telemetry={"tracing": False, "metrics": False, "logs": False},
    )
    expected = token.encode()

    # async: a plain def dependency would hop through the thread pool on every request.
    async def auth(cred: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
        given = (cred.credentials if cred else "").encode()
        if not hmac.compare_digest(given, expected):
            raise errors.Unauthorized()

    authorized = Depends(auth)
    errors.install(app)
    for route in ROUTES:
        app.add_api_route(
            route.path,
            _endpoint(api, route),
            methods=["POST"],
            dependencies=[authorized],
            response_model=None,
            responses={200: {"model": route.reply}},
        )
    _status_routes(app, api, authorized)
    app.include_router(dashboard_routes(api, authorized))

    def dropped(req: Any) -> None:
        service.apply_quietly(service.state.suspect, req.replica_id, "held connection dropped")

    on_drop = dropped if service.cfg.timeouts.suspect_on_disconnect else None
    fast = [r for r in ROUTES if r.path in membership.FAST]
    # Added last = outermost: AuthAndEpoch -> BodyLimit -> FastAPI's routing.
    ctl = service.cfg.controller
    app.add_middleware(BodyLimit, limit=ctl.max_body_bytes, timeout_s=ctl.body_timeout_s)
    app.add_middleware(
        AuthAndEpoch,
        token=expected,
        epoch=lambda: service.epoch,
        unauthorized=errors.unauthorized,
        is_public=is_public,
    )
    return app, Hot(api, fast, expected, ctl.max_body_bytes, on_drop)


def _status_routes(app: FastAPI, api: Api, authorized: Any) -> None:
    svc = api.service

    @app.get("/healthz", response_model=None, responses={200: {"model": Health}})
    async def healthz() -> Response:
        return json_response(Health(ok=True, epoch=svc.epoch))

    @app.get("/openapi.json", dependencies=[authorized], include_in_schema=False)
    async def openapi() -> dict[str, Any]:
        return app.openapi()

    @app.get("/metrics", dependencies=[authorized])
    async def metrics() -> Response:
        """Prometheus metrics (docs/operations.md lists them)."""
        return Response(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get(
        f"/{API_VERSION}/status",
        dependencies=[authorized],
        response_model=None,
        responses={200: {"model": Status}},
    )
    async def status(request: Request) -> Response:
        """The job's status: roles, replicas, quorums, the ledger, the overview, the
        journal's health. Answered even while the journal is unavailable."""
        return json_response(svc.status())

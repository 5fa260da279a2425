"""Error replies: every 4xx has the body :class:`~phalanx.protocol.base.ErrorBody`,
``{"error": ..., "fields": [{"field", "message"}]}``, naming what was wrong."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from phalanx.controller.core.base import StateError
from phalanx.protocol.base import ErrorBody

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody, "description": text}
    for code, text in {
        400: "the body is not JSON this API can read: not UTF-8, nested too deep, an "
        "integer with too many digits",
        401: "missing or wrong job token",
        409: "conflict with the job's state",
        410: "the replica is not a member (never registered, or evicted): register again",
        408: "the request body did not arrive in time (controller.body_timeout_s)",
        413: "request body too large",
        422: "invalid request: the fields named are wrong",
        503: "not acknowledged: the journal cannot take a write now (an etcd without "
        "quorum; the status API's journal says why), or this controller was deposed: retry",
    }.items()
}
"""The error replies every route may give, for the OpenAPI spec."""


class Unauthorized(Exception):
    pass


def error(status: int, message: str, fields: list[dict[str, str]] | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "fields": fields or []}, status_code=status)


async def unauthorized(request: Request, exc: Exception | None = None) -> JSONResponse:
    r = error(
        401,
        "a valid job token is required: send 'Authorization: Bearer <token>' "
        "(the token is in the state dir's 'token' file or $PHALANX_TOKEN).",
    )
    r.headers["WWW-Authenticate"] = "Bearer"
    return r


async def invalid(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)  # registered for this type only
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
    return error(422, f"invalid request: check {names}", fields)


def unreadable(cause: BaseException | None) -> str:
    """What made a body unreadable, in the words of the fix (FastAPI only says
    "There was an error parsing the body"; the cause is chained)."""
    if isinstance(cause, UnicodeDecodeError):
        return (
            f"request body must be UTF-8 JSON: got a byte that is not UTF-8 at position "
            f"{cause.start}. Encode the body as UTF-8."
        )
    if isinstance(cause, RecursionError):
        return "request body must nest at most a few hundred levels deep: got deeper JSON."
    if isinstance(cause, ValueError) and "digits" in str(cause):
        return (
            "request body must not hold integers of more than 4300 digits: got one "
            "(every integer field of this API is far smaller)."
        )
    return "request body must be JSON: it could not be read" + (
        f" ({type(cause).__name__}: {str(cause)[:200]})" if cause is not None else ""
    )


async def http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)  # registered for this type only
    detail = str(exc.detail)
    if exc.status_code == 400:
        detail = unreadable(exc.__cause__)
    fields = [{"field": "body", "message": detail}] if exc.status_code == 400 else []
    r = error(exc.status_code, detail, fields)
    r.headers.update(exc.headers or {})
    return r


async def refused(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StateError)  # registered for this type only
    fields = [{"field": exc.field, "message": str(exc)}] if exc.field else []
    return error(exc.status, str(exc), fields)


def install(app: FastAPI) -> None:
    app.add_exception_handler(Unauthorized, unauthorized)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(StateError, refused)

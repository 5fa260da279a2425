"""What an outside audit sent the controller (issue 20): extreme and loosely typed
values, anonymous and stalled bodies, bodies that are not JSON this API reads.
Each is refused at once, in one line naming the problem, and leaves the status,
the metrics and the dashboard serving."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import pytest
from procs import Controller

from phalanx.protocol.base import MAX_INT


@pytest.fixture
def ctl(start_controller) -> Iterator[Controller]:
    yield start_controller(controller={"body_timeout_s": 1.0, "max_connections": 32})


def member(ctl: Controller, name: str = "m0", role: str = "policy") -> str:
    r = ctl.post("/v1/register", {"role": role, "name": name})
    assert r.status_code == 200, r.text
    return str(r.json()["replica_id"])


def still_serving(ctl: Controller) -> None:
    assert ctl.get("/v1/status").status_code == 200
    assert ctl.get("/metrics").status_code == 200
    assert ctl.get("/v1/stream", params={"max_events": 1}).status_code == 200


# (path, a valid body, its integer fields with their bounds)
INTS: list[tuple[str, dict[str, Any], dict[str, tuple[int, int]]]] = [
    ("/v1/register", {"role": "policy", "name": "x"}, {"ranks": (1, 65536)}),
    ("/v1/heartbeat", {"replica_id": "{rid}"}, {"step": (0, MAX_INT), "inner_step": (0, MAX_INT)}),
    ("/v1/quorum", {"replica_id": "{rid}", "step": 0, "request_id": "r", "wait_s": 0}, {"step": (0, MAX_INT)}),
    ("/v1/commands/poll", {"replica_id": "{rid}"}, {"after": (0, MAX_INT)}),
    ("/v1/scale", {"role": "rollout", "replicas": 1}, {"replicas": (0, 100_000)}),
    (
        "/v1/checkpoints",
        {"replica_id": "{rid}", "step": 1, "url": "file:///ck", "nbytes": 1},
        {"step": (0, MAX_INT), "nbytes": (0, MAX_INT)},
    ),
    ("/v1/checkpoints/trigger", {}, {"lead_steps": (1, 1_000_000)}),
    ("/v1/weights/done", {"replica_id": "{rid}", "seq": 1, "version": 0, "ok": True}, {"seq": (1, MAX_INT), "version": (-1, MAX_INT)}),
    ("/v1/weights/poll", {"replica_id": "{rid}", "version": 0}, {"version": (-1, MAX_INT)}),
]  # fmt: skip


def test_every_integer_field_refuses_its_extremes_and_the_status_keeps_serving(ctl):
    """The audit's request (``nbytes = 10**400``, ``step = 10**30``) was journaled and
    broke /metrics and /v1/status for good. Past either bound, in any field, a
    request is refused with 422 naming the field; at the bounds it is served."""
    rid = member(ctl)
    for path, base, ints in INTS:
        body = json.loads(json.dumps(base).replace("{rid}", rid))
        for field, (lo, hi) in ints.items():
            for bad in (lo - 1, hi + 1, 10**30, 10**400, True, float(lo), str(lo)):
                r = ctl.post(path, {**body, field: bad})
                assert r.status_code == 422, (path, field, bad, r.status_code, r.text[:300])
                assert field in r.json()["error"], r.text[:300]
    # At the bounds: served, and the extremes journaled are still served back (a new
    # member: the first one sent no heartbeat during the loop and may be evicted).
    rid = member(ctl, "m1")
    r = ctl.post(
        "/v1/checkpoints", {"replica_id": rid, "step": MAX_INT, "url": "u", "nbytes": MAX_INT}
    )
    assert r.status_code == 200, r.text
    r = ctl.post("/v1/heartbeat", {"replica_id": rid, "step": MAX_INT, "inner_step": MAX_INT})
    assert r.status_code == 200, r.text
    still_serving(ctl)
    assert f"phalanx_checkpoint_bytes {float(MAX_INT)}" in ctl.get("/metrics").text


def test_loose_types_are_refused(ctl):
    """``{"role": "rollout", "replicas": true}`` set the desired count to 1."""
    for path, body, field in [
        ("/v1/scale", {"role": "rollout", "replicas": True}, "replicas"),
        ("/v1/register", {"role": "policy", "name": "a", "ranks": True}, "ranks"),
        ("/v1/register", {"role": "policy", "name": 5}, "name"),
        ("/v1/scale", {"role": "rollout", "replicas": "2"}, "replicas"),
    ]:
        r = ctl.post(path, body)
        assert r.status_code == 422 and field in r.json()["error"], (path, r.text)
    assert ctl.status()["roles"]["rollout"]["desired"] is None


def raw(ctl: Controller, request: bytes, timeout: float = 30.0) -> bytes:
    """Send bytes on a fresh connection; read until the server closes it."""
    u = urlsplit(ctl.url)
    with socket.create_connection((u.hostname, u.port), timeout=timeout) as s:
        s.sendall(request)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def head(ctl: Controller, path: str, length: int, token: str | None) -> bytes:
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    return (
        f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {length}\r\n\r\n"
    ).encode()


# /v1/heartbeat is one of the hot routes the fast path serves before the rest.
@pytest.mark.parametrize("path", ["/v1/register", "/v1/heartbeat"])
def test_an_anonymous_request_is_refused_before_its_body_is_read(ctl, path):
    """401 comes back with the headers alone: the 900 KB body announced is never
    sent, and the connection is closed (it held nothing for the body)."""
    reply = raw(ctl, head(ctl, path, 900_000, None))
    assert reply.startswith(b"HTTP/1.1 401"), reply[:200]
    assert b"connection: close" in reply.lower()


@pytest.mark.parametrize("path", ["/v1/register", "/v1/heartbeat"])
def test_a_stalled_body_gets_408_and_its_connection_closed(ctl, path):
    reply = raw(ctl, head(ctl, path, 100, ctl.token) + b'{"replica_id": "po')
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"body_timeout_s" in reply


def test_connections_past_the_bound_get_503(ctl):
    """32 connections at most: the 33rd request is answered 503 at once."""
    u = urlsplit(ctl.url)
    held = []
    try:
        for _ in range(40):  # authenticated requests whose body never comes: held 1 s
            s = socket.create_connection((u.hostname, u.port), timeout=30)
            s.sendall(head(ctl, "/v1/register", 100, ctl.token))
            held.append(s)
        r = ctl.get("/healthz")
        assert r.status_code == 503, r.text
    finally:
        for s in held:
            s.close()
    # The held ones timed out (408) and went: the controller serves again.
    still_serving(ctl)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b'{"role": "policy", "name": "\xff\xfe"}', b"UTF-8"),
        (b"[" * 5000 + b"]" * 5000, b"nest"),
        (b'{"role": "policy", "name": "a", "ranks": ' + b"9" * 5000 + b"}", b"digits"),
    ],
    ids=["not-utf8", "deep", "huge-int"],
)
def test_an_unreadable_body_gets_a_400_that_says_why(ctl, body: bytes, says: bytes):
    r = ctl.post(
        "/v1/register", content=body, headers={**ctl.auth(), "content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    assert says.decode() in r.json()["error"], r.text
    assert r.json()["fields"][0]["field"] == "body"
    spec = ctl.get("/openapi.json").json()
    assert "400" in spec["paths"]["/v1/register"]["post"]["responses"]


def test_pipelined_requests_are_answered_in_order(ctl):
    """Requests pipelined on one connection behind a held heartbeat (answered by the
    server's protocol itself, not through ASGI) get their replies in the order sent:
    the held one's first, then an unheld heartbeat's, then one FastAPI answers."""
    rid = member(ctl)

    def post(path: str, body: dict[str, Any], close: bool = False) -> bytes:
        data = json.dumps(body).encode()
        conn = b"Connection: close\r\n" if close else b""
        return (
            head(ctl, path, len(data), ctl.token).replace(b"\r\n\r\n", b"\r\n" + conn + b"\r\n")
            + data
        )

    held = post("/v1/heartbeat", {"replica_id": rid, "wait_s": 0.3})
    unheld = post("/v1/heartbeat", {"replica_id": rid, "wait_s": 0, "step": 7})
    last = post("/v1/register", {"role": "policy", "name": "late"}, close=True)
    reply = raw(ctl, held + unheld + last)
    assert reply.count(b"HTTP/1.1 200") == 3, reply[:600]
    first, second, third = reply.split(b"HTTP/1.1 200")[1:]
    assert b'"probe":false' in first and b'"probe":false' in second
    assert b'"replica_id":"late:' in third
    steps = {r["replica_id"]: r["step"] for r in ctl.status()["roles"]["policy"]["replicas"]}
    assert steps[rid] == 7

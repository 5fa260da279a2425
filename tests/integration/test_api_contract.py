"""The HTTP API's contract at its edges, against a real controller: the job token
guards every endpoint but /healthz, and bad input gets a 4xx JSON body that
names the field (never a 5xx) without changing state."""

from __future__ import annotations

import json

import httpx
import pytest

MAX_BODY = 8192


def _ops(ctl) -> list[tuple[str, str]]:
    spec = ctl.get("/openapi.json").json()
    ops = [(method.upper(), path) for path, item in spec["paths"].items() for method in item]
    return [*ops, ("GET", "/openapi.json")]


def test_every_endpoint_but_healthz_needs_the_token(start_controller):
    ctl = start_controller()
    ops = _ops(ctl)
    assert {("GET", "/healthz"), ("GET", "/v1/status"), ("POST", "/v1/register")} <= set(ops)
    wrong = [
        {},
        {"Authorization": "Bearer not-the-token"},
        {"Authorization": f"Bearer {ctl.token}x"},
        {"Authorization": f"Basic {ctl.token}"},
        {"Authorization": "Bearer"},
        {"Authorization": ctl.token},
    ]
    bodies = [None, b"{}", b'{"role": "policy", "name": "intruder"}', b"{not json", b"x" * 100]
    http = httpx.Client(timeout=10)
    for method, path in ops:
        for headers in wrong:
            for body in bodies:
                r = http.request(
                    method,
                    ctl.url + path,
                    headers={**headers, "Content-Type": "application/json"},
                    content=body,
                )
                where = f"{method} {path} headers={list(headers.values())} body={body!r}"
                if path == "/healthz":
                    assert r.status_code == 200, where
                    continue
                assert r.status_code == 401, f"{where}: {r.status_code} {r.text}"
                assert r.headers["WWW-Authenticate"] == "Bearer", where
                assert "job token" in r.json()["error"], where
    http.close()

    assert httpx.get(ctl.url + "/healthz").json()["ok"] is True
    for method, path in ops:
        if method == "GET":
            assert ctl.get(path).status_code == 200, path
    assert ctl.members("policy") == [] and ctl.members("rollout") == []


def _deep(levels: int) -> dict:
    d: dict = {"leaf": 1}
    for _ in range(levels):
        d = {"x": d}
    return d


RID = "<RID>"  # replaced by a registered replica's id
HUGE_INT = "1" + "0" * 5000
BAD_INPUT = [
    # (path, body (JSON-able or raw text), status, field the reply must name)
    ("/v1/register", "{not json", 422, "body"),
    ("/v1/register", "", 422, "body"),
    ("/v1/register", "[1, 2]", 422, "body"),
    ("/v1/register", "null", 422, "body"),
    ("/v1/register", {"role": 1, "name": "x"}, 422, "role"),
    ("/v1/register", {"role": "policy"}, 422, "name"),
    ("/v1/register", {"role": "policy", "name": "has space"}, 422, "name"),
    ("/v1/register", {"role": "policy", "name": "x" * 65}, 422, "name"),
    ("/v1/register", {"role": "policy", "name": "x", "ranks": 0}, 422, "ranks"),
    ("/v1/register", {"role": "policy", "name": "x", "ranks": "many"}, 422, "ranks"),
    ("/v1/register", {"role": "policy", "name": "x", "ranks": 10**30}, 422, "ranks"),
    ("/v1/register", {"role": "policy", "name": "x", "address": "a" * 257}, 422, "address"),
    ("/v1/register", {"role": "policy", "name": "x", "colour": "red"}, 422, "colour"),
    ("/v1/register", {"role": "reward", "name": "x"}, 400, "role"),
    ("/v1/register", {"role": "policy", "name": "x", "capabilities": [1]}, 422, "capabilities"),
    (
        "/v1/register",
        {"role": "policy", "name": "x", "capabilities": {"g": {}}},
        422,
        "capabilities.g",
    ),
    (
        "/v1/register",
        '{"role": "policy", "name": "x", "capabilities": {"g": NaN}}',
        422,
        "capabilities.g",
    ),
    ("/v1/heartbeat", {"replica_id": RID, "step": -1}, 422, "step"),
    ("/v1/heartbeat", {"replica_id": RID, "step": 2**63}, 422, "step"),
    ("/v1/heartbeat", {"replica_id": RID, "wait_s": 31}, 422, "wait_s"),
    ("/v1/heartbeat", '{"replica_id": "<RID>", "wait_s": Infinity}', 422, "wait_s"),
    ("/v1/heartbeat", '{"replica_id": "<RID>", "step": ' + HUGE_INT + "}", 400, "body"),
    ("/v1/heartbeat", {"replica_id": ""}, 422, "replica_id"),
    ("/v1/heartbeat", {"replica_id": ["x"]}, 422, "replica_id"),
    ("/v1/heartbeat", {"replica_id": "ghost:0"}, 410, "replica_id"),
    ("/v1/quorum", {"replica_id": RID, "step": 0}, 422, "request_id"),
    (
        "/v1/quorum",
        {"replica_id": RID, "step": 0, "request_id": "r", "timeout_s": 0},
        422,
        "timeout_s",
    ),
    ("/v1/quorum", {"replica_id": RID, "step": 0, "request_id": "r", "wait_s": -1}, 422, "wait_s"),
    ("/v1/quorum", {"replica_id": RID, "step": 1.5, "request_id": "r"}, 422, "step"),
    ("/v1/quorum", {"replica_id": "ghost:0", "step": 0, "request_id": "r"}, 410, "replica_id"),
    ("/v1/commands/poll", {"replica_id": RID, "after": -1}, 422, "after"),
    ("/v1/commands/poll", {"replica_id": "ghost:0"}, 410, "replica_id"),
    ("/v1/commands/ack", {"replica_id": RID, "ids": []}, 422, "ids"),
    ("/v1/commands/ack", {"replica_id": RID, "ids": [0]}, 422, "ids.0"),
    ("/v1/commands/ack", {"replica_id": RID, "ids": "1"}, 422, "ids"),
    ("/v1/commands", {"target": RID, "kind": "bad kind"}, 422, "kind"),
    ("/v1/commands", {"target": RID, "kind": "k", "payload": []}, 422, "payload"),
    ("/v1/commands", {"target": RID, "kind": "k", "payload": _deep(40)}, 422, "payload"),
    ("/v1/commands", '{"target": "<RID>", "kind": "k", "payload": {"x": NaN}}', 422, "payload"),
    (
        "/v1/commands",
        '{"target": "<RID>", "kind": "k", "payload": {"x": ["\\ud800"]}}',
        422,
        "payload",
    ),
    ("/v1/commands", {"target": "ghost:0", "kind": "k"}, 410, "target"),
    ("/v1/report-failure", {"reporter": RID, "suspects": RID}, 422, "suspects"),
    ("/v1/report-failure", {"reporter": RID, "suspects": [RID]}, 400, "suspects"),
    ("/v1/report-failure", {"reporter": RID, "failed_commit": "maybe"}, 422, "failed_commit"),
    ("/v1/report-failure", {"reporter": "ghost:0", "suspects": [RID]}, 410, "reporter"),
    ("/v1/deregister", {"replica_id": RID, "reason": "r" * 1001}, 422, "reason"),
    ("/v1/deregister", {"replica_id": RID, "also": 1}, 422, "also"),
]


def _roles(status: dict) -> dict:
    """The roles' state, less the clock (seconds since each heartbeat)."""
    return {
        name: {
            **role,
            "replicas": [
                {k: v for k, v in m.items() if k != "seconds_since_heartbeat"}
                for m in role["replicas"]
            ],
        }
        for name, role in status["roles"].items()
    }


@pytest.fixture
def api(start_controller):
    """A controller with one registered replica that no timeout evicts meanwhile."""
    ctl = start_controller(heartbeat_s=60.0, quorum_s=120.0, max_body_bytes=MAX_BODY)
    rid = ctl.post("/v1/register", {"role": "policy", "name": "m"}).json()["replica_id"]
    return ctl, rid


def test_bad_input_gets_4xx_naming_the_field_and_changes_nothing(api):
    ctl, rid = api
    before = ctl.status()
    for path, body, status, field in BAD_INPUT:
        text = body if isinstance(body, str) else json.dumps(body)
        text = text.replace(RID, rid)
        r = ctl.post(
            path, content=text.encode(), headers={**ctl.auth(), "Content-Type": "application/json"}
        )
        where = f"POST {path} {text[:120]!r}"
        assert r.status_code == status, f"{where}: {r.status_code} {r.text[:300]}"
        err = r.json()
        named = [f["field"] for f in err["fields"]]
        assert any(n == field or n.startswith(field + ".") for n in named), f"{where}: {err}"
        assert err["error"], where

    after = ctl.status()
    assert _roles(after) == _roles(before)
    assert [e for e in after["events"] if e["seq"] > before["events"][-1]["seq"]] == []
    r = ctl.post("/v1/commands/poll", {"replica_id": rid})
    assert r.status_code == 200 and r.json()["commands"] == []


def test_body_over_the_limit_gets_413(api):
    ctl, rid = api
    headers = {**ctl.auth(), "Content-Type": "application/json"}
    fits = json.dumps({"replica_id": rid}).encode().ljust(MAX_BODY, b" ")
    assert ctl.post("/v1/heartbeat", content=fits, headers=headers).status_code == 200

    big = json.dumps({"replica_id": rid, "reason": "x" * MAX_BODY}).encode()
    r = ctl.post("/v1/deregister", content=big, headers=headers)
    assert r.status_code == 413 and str(MAX_BODY) in r.json()["error"]

    def chunks():  # no Content-Length: the limit must hold for a streamed body too
        yield b'{"replica_id": "' + rid.encode() + b'", "reason": "'
        for _ in range(MAX_BODY // 512 + 1):
            yield b"x" * 512
        yield b'"}'

    r = ctl.post("/v1/deregister", content=chunks(), headers=headers)
    assert r.status_code == 413, r.text
    assert rid in ctl.members()

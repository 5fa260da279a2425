"""Fuzz the controller's API from its own OpenAPI spec (schemathesis + hypothesis),
against a real controller: valid and invalid requests for every operation,
never a 5xx, and a rejected (4xx) request never changes membership."""

from __future__ import annotations

import time
from typing import Any

import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

EXAMPLES = 30


def _aim(spec: dict[str, Any], replica_ids: list[str]) -> dict[str, Any]:
    """Narrow the served spec's identifiers to this job's roles and replicas (plus
    one unknown of each), so that valid requests reach the state machine
    instead of all bouncing off as unknown ids."""
    ids = {"enum": [*replica_ids, "ghost:0"]}
    for model in spec["components"]["schemas"].values():
        props = model.get("properties", {})
        for name in ("replica_id", "reporter"):
            if name in props:
                props[name] = ids
        if "target" in props:
            props["target"] = {"enum": [*ids["enum"], "policy", "rollout", "reward"]}
        if "suspects" in props:
            props["suspects"]["items"] = ids
        if "role" in props:
            props["role"] = {"enum": ["policy", "rollout", "reward"]}
    return spec


def _short_waits(case: Any) -> None:
    """Cap a valid long-poll wait (the server allows up to 30 s; a quorum request
    waits 10 s by default) so that a request that reaches a member returns
    quickly; an invalid wait is sent as it is."""
    body = case.body
    if isinstance(body, dict):
        if case.path == "/v1/quorum":
            body.setdefault("wait_s", 0.2)
        wait = body.get("wait_s")
        if isinstance(wait, int | float) and not isinstance(wait, bool) and 0.2 < wait <= 30:
            body["wait_s"] = 0.2


# A fixed amount of work (about 1,700 requests and as many status reads): 45 s on a
# quiet 2-core machine, several times that beside other test files on a busy one.
def test_api_fuzzed_from_its_openapi_spec(start_controller):
    # A heartbeat timeout longer than the test's own limit: the replicas registered
    # here never heartbeat, and membership must change only through the fuzzed
    # requests themselves, never by an eviction behind their back (a loaded machine
    # once stretched the run past a 120 s timeout).
    ctl = start_controller(heartbeat_s=3600.0, quorum_s=7200.0, suspect_grace_s=60.0)
    r = ctl.get("/openapi.json")
    assert r.status_code == 200
    ids = []
    for role, name in [("policy", "m0"), ("policy", "m1"), ("policy", "m2"), ("rollout", "r0")]:
        ids.append(ctl.post("/v1/register", {"role": role, "name": name}).json()["replica_id"])
    schema = schemathesis.openapi.from_dict(_aim(r.json(), ids))

    session = requests.Session()
    session.headers.update(ctl.auth())

    def membership() -> dict[str, list[str]]:
        roles = session.get(ctl.url + "/v1/status", timeout=10).json()["roles"]
        return {role: sorted(m["replica_id"] for m in r["replicas"]) for role, r in roles.items()}

    # Nothing but the requests changes membership here, so the membership after
    # one request is the membership before the next.
    known = [membership()]
    seen: dict[tuple[str, int], int] = {}
    t0 = time.monotonic()
    for result in schema.get_all_operations():
        op = result.ok()
        # Only an operation that takes input has invalid input to generate.
        has_input = bool(op.body) or any(
            len(params) for params in (op.query, op.path_parameters, op.headers)
        )
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if has_input else [])
        for mode in modes:

            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                database=None,
                phases=[Phase.explicit, Phase.generate],  # no shrinking against live state
                suppress_health_check=list(HealthCheck),
            )
            @given(case=op.as_strategy(generation_mode=mode))
            def check(case) -> None:
                _short_waits(case)
                before = known[0]
                resp = case.call(base_url=ctl.url, session=session, headers=ctl.auth(), timeout=10)
                known[0] = after = membership()
                where = f"{case.method} {case.path} body={case.body!r} -> {resp.status_code}"
                seen[(case.path, resp.status_code)] = seen.get((case.path, resp.status_code), 0) + 1
                assert resp.status_code < 500, f"{where}: {resp.text[:500]}"
                if 400 <= resp.status_code < 500:
                    assert resp.json()["error"], where
                    assert after == before, f"rejected request changed membership: {where}"

            check()
    elapsed = time.monotonic() - t0
    print(f"fuzzed {sum(seen.values())} requests in {elapsed:.1f} s: {sorted(seen)}")
    assert any(400 <= status < 500 for _, status in seen), "no invalid request was generated"
    assert ctl.get("/healthz").status_code == 200

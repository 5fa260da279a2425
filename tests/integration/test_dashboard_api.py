"""The dashboard's endpoints against a real controller: the page is public but holds
no job data, everything else (status, the event stream, actions, metrics) needs the
job token; the stream speaks server-sent events; actions change the job."""

from __future__ import annotations

import json

import httpx


def test_page_is_public_but_shows_only_a_token_prompt(start_controller):
    ctl = start_controller()
    page = httpx.get(ctl.url + "/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'id="token-prompt"' in page.text and ctl.status()["job_id"] not in page.text
    assert "default-src 'self'" in page.headers["content-security-policy"]
    for name in ("app.js", "style.css"):
        assert httpx.get(f"{ctl.url}/dashboard/{name}", timeout=10).status_code == 200
    # Nothing else is public: not another file, not the API, not the stream.
    for path in ("/dashboard/x.js", "/v1/status", "/v1/stream", "/metrics"):
        r = httpx.get(ctl.url + path, timeout=10)
        assert r.status_code == 401, path
    r = httpx.get(ctl.url + "/v1/stream", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert r.status_code == 401 and "job token" in r.json()["error"]
    r = httpx.post(ctl.url + "/v1/replicas/evict", json={"replica_id": "x"}, timeout=10)
    assert r.status_code == 401


def test_stream_actions_and_metrics(start_controller):
    # The member registered below heartbeats only now and then: a loaded machine must
    # not see it evicted before its state is read.
    ctl = start_controller(heartbeat_s=3600.0, quorum_s=7200.0)
    rid = ctl.post("/v1/register", {"role": "policy", "name": "a", "address": "h:1"}).json()[
        "replica_id"
    ]
    with httpx.stream(
        "GET", ctl.url + "/v1/stream?max_events=1", headers=ctl.auth(), timeout=10
    ) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = r.read().decode()
    events = [e for e in text.split("\n\n") if e]
    assert len(events) == 1 and all(e.startswith("event: status\ndata: ") for e in events)
    st = json.loads(events[0].split("data: ", 1)[1])
    (rep,) = st["overview"]["roles"]["policy"]["replicas"]
    assert rep["replica_id"] == rid and rep["state"] == "joining" and rep["address"] == "h:1"

    ctl.post("/v1/heartbeat", {"replica_id": rid})  # fast timeouts: keep it alive
    metrics = ctl.get("/metrics").text
    for name in (
        'phalanx_replicas_by_state{role="policy",state="joining"} 1.0',
        "phalanx_replica_heartbeat_age_seconds{",
        "phalanx_replica_uptime_seconds{",
        "phalanx_steps_per_second{",
    ):
        assert name in metrics, name

    ctl.post("/v1/heartbeat", {"replica_id": rid})
    r = ctl.post("/v1/checkpoints/trigger", {})
    assert r.status_code == 409 and "checkpoint.url" in r.json()["error"]
    assert ctl.post("/v1/replicas/drain", {"replica_id": rid}).json()["commands"][0]["kind"] == (
        "drain"
    )
    assert ctl.post("/v1/replicas/evict", {"replica_id": rid, "reason": "t"}).status_code == 200
    assert ctl.post("/v1/replicas/evict", {"replica_id": rid}).status_code == 410
    st = ctl.status()
    assert st["overview"]["roles"]["policy"]["evicted"][-1]["detector"] == "operator"
    assert 'phalanx_evictions_by_detector_total{detector="operator",role="policy"} 1.0' in (
        ctl.get("/metrics").text
    )

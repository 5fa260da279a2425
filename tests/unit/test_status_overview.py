"""The job overview (dashboard, ``phalanx status``, ``/metrics``) from the pure state
machine: replica states, the eviction detector and the time from failure to quorum,
steps per second, and the terminal tables."""

from __future__ import annotations

from phalanx.config import load_config
from phalanx.controller.core.overview import detector_of
from phalanx.controller.core.state import ControllerState

GRACE_S = 0.25


def make_state() -> ControllerState:
    cfg = load_config(
        overrides=[
            "timeouts.heartbeat_s=10",
            f"timeouts.suspect_grace_s={GRACE_S}",
            "roles.policy.min_replicas=1",
            "roles.policy.n_init_replicas=2",
            "roles.policy.join_timeout_s=1",
            "roles.rollout.min_replicas=1",
        ]
    )
    return ControllerState(cfg)


def form(st: ControllerState, rids: list[str], step: int, now: float) -> None:
    for rid in rids:
        st.request_quorum(rid, step, f"{rid}@{now}", 60.0, now=now, wall=1000 + now)


def states(st: ControllerState, now: float) -> dict[str, str]:
    reps = st.status(now, 1000 + now).model_dump(mode="json")["overview"]["roles"]["policy"][
        "replicas"
    ]
    return {r["name"]: r["state"] for r in reps}


def test_replica_states_detector_and_recovery_time():
    st = make_state()
    a, b = (st.register("policy", n, "i0", now=0, wall=1000)[0].replica_id for n in ("a", "b"))
    assert states(st, 0) == {"a": "joining", "b": "joining"}
    form(st, [a, b], step=0, now=1)
    assert states(st, 1) == {"a": "active", "b": "active"}
    kinds = [e["kind"] for e in st.events]
    assert kinds.count("active") == 2
    st.heartbeat(a, now=2, wall=1002, step=5, loss=0.5)
    form(st, [a], step=5, now=2.5)
    form(st, [b], step=0, now=2.5)  # b is behind: a heals it
    assert states(st, 2.5) == {"a": "active", "b": "healing"}

    # A peer reports b: suspected, then evicted by the failure-report detector.
    st.report_failure(a, [b], now=3, wall=1003, reason="allreduce failed")
    assert states(st, 3) == {"a": "active", "b": "suspected"}
    st.tick(now=3 + GRACE_S, wall=1003 + GRACE_S)
    ev = next(e for e in st.events if e["kind"] == "evict")
    assert ev["detector"] == "failure_report" and ev["failed_at"] == 1003
    st.heartbeat(a, now=3.5, wall=1003.5, step=6)
    form(st, [a], step=6, now=4)
    q = [e for e in st.events if e["kind"] == "quorum"][-1]
    assert q["recovered"] == [{"replica_id": b, "detector": "failure_report", "seconds": 1.0}]

    ov = st.status(4, 1004).model_dump(mode="json")["overview"]
    assert ov["roles"]["policy"]["evicted"][0]["detector"] == "failure_report"
    assert ov["job"]["step"] == 6 and ov["job"]["steps_per_s"] == 0.5  # (6 - 5) / (4 - 2)
    assert ov["series"]["loss"] == [[5, 0.5]]
    rep = ov["roles"]["policy"]["replicas"][0]
    assert rep["incarnation"] == "i0" and rep["uptime_s"] == 4.0 and rep["weights_version"] == 6
    assert any(e["kind"] == "evict" for e in ov["timeline"])


def test_detector_of_each_reason():
    assert detector_of("heartbeat timeout") == "heartbeat"
    assert detector_of("failure report, no heartbeat in grace") == "failure_report"
    assert detector_of("held connection dropped, no heartbeat in grace") == "disconnect"
    assert detector_of("left: exit -9 (reported by agent n1)") == "agent"
    assert detector_of("replaced by a new incarnation") == "replaced"
    assert detector_of("evicted by operator: x") == "operator"
    assert detector_of("left: finished") == "left"


def test_operator_actions():
    st = make_state()
    a = st.register("policy", "a", "i0", now=0, wall=1000)[0].replica_id
    cmds, _ = st.drain_replica(a, now=1, wall=1001)
    assert [c.kind for c in cmds] == ["drain"]
    st.evict_replica(a, "test", now=2, wall=1002)
    ev = st.events[-1]
    assert ev["kind"] == "evict" and ev["detector"] == "operator" and a not in st.members
    assert not st.roles["policy"].failures  # an operator's eviction is no failure to time


def test_status_tables_render():
    from rich.console import Console

    from phalanx.console.status_view import status_tables

    st = make_state()
    a = st.register("policy", "a", "i0", now=0, wall=1000)[0].replica_id
    st.evict_replica(a, "test", now=1, wall=1001)
    st.register("policy", "a", "i1", now=1, wall=1001)
    console = Console(width=140, record=True)
    console.print(status_tables(st.status(2, 1002)))
    out = console.export_text()
    assert "joining" in out and "evicted" in out and "by operator" in out


def test_timeline_folds_a_run_of_weight_syncs_into_one_event():
    from rich.console import Console

    from phalanx.console.status_view import status_tables
    from phalanx.controller.core.overview import _timeline
    from phalanx.protocol.status import Event

    def sync(seq: int) -> dict:
        return {"kind": "sync_done", "seq": seq, "version": 2 * seq, "at": 1000.0 + seq}

    join = {"kind": "join", "replica_id": "r:1", "role": "rollout", "at": 1003.5}
    tl = _timeline([sync(1), sync(2), sync(3), join, sync(4), {"kind": "heartbeat"}])
    assert [e["kind"] for e in tl] == ["sync_done", "join", "sync_done"]
    assert (tl[0]["runs"], tl[0]["first_seq"], tl[0]["seq"], tl[0]["first_version"]) == (3, 1, 3, 2)
    assert "runs" not in tl[2]  # a lone sync stays as it was
    # The words come with the events, for the dashboard and the terminal alike.
    assert tl[0]["text"] == "weight syncs 1-3 done (3, v2 to v6)"
    assert tl[1]["text"] == "r:1 joined rollout"
    assert tl[2]["text"] == "weight sync 4 done (v8)"

    st = make_state()
    st.register("policy", "a", "i0", now=0, wall=1000)
    status = st.status(2, 1002)
    timeline = [Event.model_validate(e) for e in tl]
    status = status.model_copy(
        update={"overview": status.overview.model_copy(update={"timeline": timeline})}
    )
    console = Console(width=140, record=True)
    console.print(status_tables(status))
    out = console.export_text()
    assert "weight syncs 1-3 done" in out and "r:1 joined rollout" in out


def test_diloco_inner_step_is_live_from_heartbeats():
    """Committed rounds x H at a round's boundary; further while the replicas report
    inner steps of the round in progress with their heartbeats (not journaled)."""
    st = ControllerState(load_config("examples/diloco_sync.toml"))  # H = 20, 3 replicas
    rids = [st.register("policy", n, "i0", now=0, wall=1000)[0].replica_id for n in "abc"]
    form(st, rids, 0, now=0.1)

    def diloco(now: float) -> dict:
        return st.status(now, 1000 + now).model_dump(mode="json")["overview"]["job"]["diloco"]

    assert diloco(0.2) == {"outer_step": 0, "inner_step": 0, "sync_every": 20}
    st.heartbeat(rids[0], now=0.3, step=0, inner_step=7)
    st.heartbeat(rids[1], now=0.3, step=0, inner_step=9)
    assert diloco(0.4)["inner_step"] == 9
    reps = st.status(0.4, 1000.4).model_dump(mode="json")["overview"]["roles"]["policy"]["replicas"]
    assert {r["name"]: r["inner_step"] for r in reps} == {"a": 7, "b": 9, "c": None}
    assert "inner_step" not in st.members[rids[0]].record()  # liveness only


def test_an_event_without_its_usual_fields_still_reads():
    """The words are made on every status request: a malformed event must not break it."""
    from phalanx.controller.core.event_text import describe

    assert describe({"kind": "quorum", "role": "policy"}) == "quorum policy"
    assert describe({"kind": "checkpoint", "step": 3}) == "checkpoint"
    assert describe({"kind": "evict", "replica_id": "a:1", "reason": "gone"}) == (
        "a:1 evicted by ?: gone"
    )
    assert describe({"kind": "active", "replica_id": "a:1"}) == "a:1 active - s after joining"
    assert describe({}) == "event"
    left = {"kind": "evict", "replica_id": "a:1", "detector": "left", "reason": "left: finished"}
    assert describe(left) == "a:1 left: finished"


def test_a_reported_heal_is_on_the_timeline_with_its_time():
    st = make_state()
    a, b = (st.register("policy", n, "i0", now=0, wall=1000)[0].replica_id for n in ("a", "b"))
    heal = {"source": a, "step": 7, "seconds": 0.031, "quorum_id": 3}
    st.heartbeat(b, now=1, wall=1001, healed=heal)
    st.heartbeat(b, now=2, wall=1002)  # reported once
    tl = st.status(3, 1003).model_dump(mode="json")["overview"]["timeline"]
    healed = [e for e in tl if e["kind"] == "healed"]
    assert len(healed) == 1 and healed[0]["at"] == 1001
    assert {k: healed[0][k] for k in heal} == heal and healed[0]["role"] == "policy"
    assert healed[0]["text"] == f"{b} healed from {a} to step 7 in 0.031 s"


def test_text_from_the_wire_is_never_read_as_rich_markup():
    """A replica address with markup (``[/bold]`` made ``phalanx status`` exit 1 with a
    MarkupError; ``[link=...]`` rendered as a link): shown as it is, on a terminal."""
    from rich.console import Console

    from phalanx.console.status_view import status_tables

    st = make_state()
    addr = "[/bold] [link=http://evil]click[/link] [red]x"
    st.register("policy", "a", "i0", now=0, wall=1000, address=addr)
    console = Console(width=200, record=True, force_terminal=True)
    console.print(status_tables(st.status(1, 1001)))
    out = console.export_text()
    assert addr in out
    assert "http://evil" in out  # as text: no hyperlink was made of it
    assert "\x1b]8;" not in console.export_text(styles=True)

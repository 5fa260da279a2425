"""The failure detectors with real processes and real signals: a peer's failure
report (fast path), the heartbeat timeout (slow path), a dropped connection
(held heartbeat, quorum request or lifeline), a dead replica's address that
refuses the controller's probe, and a false report against a live replica
(which answers the probe and stays)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from procs import Controller, check_rounds, names, signal_group, wait_for

from phalanx.client import ControllerClient

FAST_PATH_REASON = "failure report, no heartbeat in grace"


@pytest.fixture
def detector() -> Iterator[list[ControllerClient]]:
    """Stands in for a peer whose collective failed: a rollout-role member (so it
    does not take part in the policy quorum) that files failure reports."""
    made: list[ControllerClient] = []
    yield made
    for c in made:
        c.close()


def _detector(made: list[ControllerClient], ctl: Controller) -> ControllerClient:
    c = ControllerClient(str(ctl.state_dir), "rollout", "detector")
    made.append(c)
    c.start_heartbeat()
    return c


def _three_in_quorum(ctl, start_replica):
    reps = {n: start_replica(ctl, n) for n in "abc"}
    for r in reps.values():
        r.wait_line(lambda x: names(x["members"]) == {"a", "b", "c"}, 30, "a quorum of a, b, c")
    return reps


def test_sigkilled_replica_is_evicted_fast_by_a_failure_report(
    start_controller, start_replica, detector, record_property
):
    hb = 20.0
    # A long join timeout: the survivors cannot re-form before c is evicted, and
    # a long heartbeat timeout: only the failure report can evict it in time.
    # No suspicion on a dropped connection either: this test isolates the report.
    ctl = start_controller(
        n_init=3, join_timeout_s=60.0, heartbeat_s=hb, quorum_s=60.0, suspect_on_disconnect=False
    )
    reporter = _detector(detector, ctl)
    reps = _three_in_quorum(ctl, start_replica)
    c = reps["c"]
    c_id = c.replica_id()

    c.signal(signal.SIGKILL)
    c.proc.wait(timeout=10)
    killed_at = time.monotonic()
    marks = {n: len(reps[n].lines()) for n in "ab"}
    reported_at = time.monotonic()
    assert reporter.report_failure([c_id], reason="all-reduce: connection reset by peer") == []
    wait_for(lambda: c_id not in ctl.members(), hb / 2, "the reported replica to be evicted")
    latency = time.monotonic() - reported_at
    record_property("eviction_latency_s", latency)
    print(f"eviction latency after a failure report: {latency * 1000:.0f} ms (heartbeat_s={hb})")
    assert latency < hb / 2
    assert ctl.evictions(c_id)[-1]["reason"] == FAST_PATH_REASON

    for n in "ab":
        line = reps[n].wait_line(
            lambda x: c_id not in x["members"], hb / 2, "a quorum without c", after=marks[n]
        )
        assert names(line["members"]) == {"a", "b"}
    assert time.monotonic() - killed_at < hb / 2
    check_rounds([r.lines() for r in reps.values()])


def test_sigkilled_replica_is_evicted_by_heartbeat_timeout_alone(start_controller, start_replica):
    hb = 3.0
    ctl = start_controller(
        n_init=3, join_timeout_s=30.0, heartbeat_s=hb, suspect_on_disconnect=False
    )
    reps = _three_in_quorum(ctl, start_replica)
    c = reps["c"]
    c_id = c.replica_id()
    marks = {n: len(reps[n].lines()) for n in "ab"}

    c.signal(signal.SIGKILL)
    c.proc.wait(timeout=10)
    t0 = time.monotonic()
    wait_for(lambda: c_id not in ctl.members(), hb + 5, "the killed replica to be evicted")
    latency = time.monotonic() - t0
    print(f"eviction by heartbeat timeout after {latency:.2f} s (heartbeat_s={hb})")
    assert ctl.evictions(c_id)[-1]["reason"] == "heartbeat timeout"
    assert latency > hb / 2, "evicted too early for the heartbeat timeout"

    for n in "ab":
        line = reps[n].wait_line(
            lambda x: c_id not in x["members"], 10, "a quorum without c", after=marks[n]
        )
        assert names(line["members"]) == {"a", "b"}
    check_rounds([r.lines() for r in reps.values()])


def test_sigkilled_replica_is_evicted_fast_by_its_dropped_connection(
    start_controller, start_replica
):
    """No peer report, no collective: the killed process's held heartbeat drops,
    the controller suspects it and evicts it after the grace."""
    hb = 20.0
    ctl = start_controller(n_init=3, join_timeout_s=60.0, heartbeat_s=hb, quorum_s=60.0)
    reps = _three_in_quorum(ctl, start_replica)
    c = reps["c"]
    c_id = c.replica_id()
    marks = {n: len(reps[n].lines()) for n in "ab"}

    c.signal(signal.SIGKILL)
    c.proc.wait(timeout=10)
    t0 = time.monotonic()
    wait_for(lambda: c_id not in ctl.members(), hb / 2, "the killed replica to be evicted")
    latency = time.monotonic() - t0
    print(f"eviction after a dropped connection: {latency * 1000:.0f} ms (heartbeat_s={hb})")
    assert ctl.evictions(c_id)[-1]["reason"] == "held connection dropped, no heartbeat in grace"
    for n in "ab":
        line = reps[n].wait_line(
            lambda x: c_id not in x["members"], hb / 2, "a quorum without c", after=marks[n]
        )
        assert names(line["members"]) == {"a", "b"}
    check_rounds([r.lines() for r in reps.values()])


def test_false_failure_report_does_not_evict_a_live_replica(
    start_controller, start_replica, detector
):
    grace = 1.0
    # The heartbeat interval is longer than the grace, so a suspect survives only
    # by answering the probe (its held heartbeat returns at once, and it re-beats).
    # (A long join timeout too: no partial quorum of a slow moment bumps quorum_id.)
    ctl = start_controller(
        n_init=2,
        join_timeout_s=30.0,
        heartbeat_interval_s=2.0,
        heartbeat_s=8.0,
        suspect_grace_s=grace,
    )
    reporter = _detector(detector, ctl)
    reps = {n: start_replica(ctl, n) for n in "ab"}
    for r in reps.values():
        r.wait_line(lambda x: names(x["members"]) == {"a", "b"}, 30, "a quorum of a and b")
    a = reps["a"]
    a_id = a.replica_id()
    quorum_id = a.last()["quorum_id"]
    mark = len(a.lines())

    reports = 4
    for _ in range(reports):
        assert reporter.report_failure([a_id], reason="false alarm") == []
        time.sleep(grace * 1.5)

    assert a_id in ctl.members()
    assert ctl.evictions(a_id) == []
    wait_for(
        lambda: (
            not next(
                m for m in ctl.status()["roles"]["policy"]["replicas"] if m["replica_id"] == a_id
            )["suspect"]
        ),
        grace,
        "the suspicion to be cleared",
    )
    assert f"phalanx_failure_reports_total {reports:.1f}" in ctl.get("/metrics").text
    a.wait_line(lambda x: True, 10, "another quorum", after=mark)
    for x in a.lines()[mark:]:
        assert x["replica_id"] == a_id and x["quorum_id"] == quorum_id
    check_rounds([r.lines() for r in reps.values()])


MEMBER = """
import sys, time
from phalanx.client import ControllerClient
c = ControllerClient(sys.argv[1], "rollout", "lone")
c.start_heartbeat()
print(c.replica_id, flush=True)
time.sleep(600)
"""


def test_sigkill_between_heartbeats_is_caught_by_the_lifeline(start_controller, procs):
    """A process whose held heartbeat was answered, and that has not sent the next
    one (here: SIGSTOPped; in life, a busy process whose heartbeat thread waits
    for the GIL), holds no heartbeat. Killed then, only its lifeline connection
    drops: it is evicted after the grace, not after the heartbeat timeout."""
    hb, interval = 20.0, 0.3
    ctl = start_controller(heartbeat_s=hb, heartbeat_interval_s=interval, quorum_s=60.0)
    p, out, _ = procs.spawn([sys.executable, "-c", MEMBER, str(ctl.state_dir)], "lone")
    wait_for(lambda: out.read_text().strip() != "", 30, "the member to register")
    rid = out.read_text().strip()
    wait_for(lambda: rid in ctl.members("rollout"), 10, "the member to be listed")
    time.sleep(2.0)  # its lifeline is held by now (posted right after registering)

    signal_group(p, signal.SIGSTOP)
    time.sleep(interval + 1.0)  # its last held heartbeat has been answered
    assert rid in ctl.members("rollout")
    signal_group(p, signal.SIGKILL)
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    t0 = time.monotonic()
    wait_for(lambda: rid not in ctl.members("rollout"), hb / 2, "the killed member to be evicted")
    latency = time.monotonic() - t0
    print(f"eviction after a kill between heartbeats: {latency * 1000:.0f} ms (heartbeat_s={hb})")
    ev = ctl.evictions(rid)[-1]
    assert ev["reason"] == "held connection dropped, no heartbeat in grace", ev


STORE_MEMBER = """
import sys, time
from phalanx.client import ControllerClient
from phalanx.comm.torch_pg import serve_store
store, address = serve_store()
c = ControllerClient(sys.argv[1], "rollout", "served", address=address)
c.start_heartbeat()
print(c.replica_id, flush=True)
time.sleep(600)
"""


def test_a_dead_replica_whose_address_refuses_is_evicted_without_its_grace(
    start_controller, procs, detector
):
    """A replica that serves its rendezvous store: a false report against it is
    probed and cleared (its store accepts the controller's connection); once it is
    SIGKILLed, its dropped connection makes it a suspect, its store refuses the
    controller's connection, and it is evicted at once, not after the grace (the
    reason names which of the two evicted it)."""
    grace = 5.0
    ctl = start_controller(heartbeat_s=20.0, heartbeat_interval_s=2.0, suspect_grace_s=grace)
    reporter = _detector(detector, ctl)
    p, out, _ = procs.spawn([sys.executable, "-c", STORE_MEMBER, str(ctl.state_dir)], "served")
    wait_for(lambda: out.read_text().strip() != "", 60, "the member to register")
    rid = out.read_text().strip()

    def suspected() -> bool:
        reps = ctl.status()["roles"]["rollout"]["replicas"]
        return next(m for m in reps if m["replica_id"] == rid)["suspect"]

    assert reporter.report_failure([rid], reason="false alarm") == []
    wait_for(lambda: not suspected(), grace * 2, "the suspicion to be cleared")
    assert ctl.evictions(rid) == []

    signal_group(p, signal.SIGKILL)
    p.wait(timeout=10)
    wait_for(lambda: rid not in ctl.members("rollout"), grace * 2, "the killed member's eviction")
    ev = ctl.evictions(rid)[-1]
    assert ev["reason"] == "held connection dropped, address refused", ev
    assert ev["detector"] == "disconnect", ev

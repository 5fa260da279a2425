"""Elastic membership with real processes: replicas join, leave cleanly, and a
SIGSTOPped one is evicted and comes back as a new incarnation."""

from __future__ import annotations

import signal
import time

from procs import check_rounds, cli_status, names, wait_for


def _quorum_ids(replica, members: set[str]) -> list[int]:
    return [x["quorum_id"] for x in replica.lines() if names(x["members"]) == members]


def test_replicas_join_leave_and_a_newcomer_is_included(start_controller, start_replica):
    # A heartbeat timeout well above any scheduling hiccup: nobody leaves but c.
    ctl = start_controller(n_init=3, heartbeat_s=10.0)
    reps = {n: start_replica(ctl, n) for n in "abc"}
    for r in reps.values():
        r.wait_line(lambda x: names(x["members"]) == {"a", "b", "c"}, 30, "a quorum of a, b, c")

    # c leaves cleanly (SIGTERM -> ControllerClient.close -> deregister).
    c = reps.pop("c")
    c_id = c.replica_id()
    marks = {n: len(r.lines()) for n, r in reps.items()}
    c.signal(signal.SIGTERM)
    assert c.proc.wait(timeout=10) == 0, c.err.read_text()
    assert c_id not in ctl.members()
    assert ctl.evictions(c_id)[-1]["reason"].startswith("left")
    q_abc = max(_quorum_ids(reps["a"], {"a", "b", "c"}))
    for n, r in reps.items():
        line = r.wait_line(
            lambda x: names(x["members"]) == {"a", "b"}, 10, "a quorum without c", after=marks[n]
        )
        assert line["quorum_id"] > q_abc

    # d joins and is taken in at a later step, healed to the quorum's step.
    q_ab = max(_quorum_ids(reps["a"], {"a", "b"}))
    reps["d"] = start_replica(ctl, "d")
    for r in reps.values():
        line = r.wait_line(lambda x: names(x["members"]) == {"a", "b", "d"}, 30, "a quorum with d")
        assert line["quorum_id"] > q_ab
    first_d = reps["d"].lines()[0]
    assert first_d["step"] > 0, "d joined late, so it must have healed to the running step"

    check_rounds([r.lines() for r in [*reps.values(), c]])


def test_sigstopped_replica_is_evicted_then_rejoins_as_a_new_incarnation(
    start_controller, start_replica
):
    hb = 3.0
    ctl = start_controller(n_init=3, heartbeat_s=hb)
    reps = {n: start_replica(ctl, n) for n in "abc"}
    for r in reps.values():
        r.wait_line(lambda x: names(x["members"]) == {"a", "b", "c"}, 30, "a quorum of a, b, c")
    c = reps["c"]
    old_id = c.replica_id()
    marks = {n: len(r.lines()) for n, r in reps.items()}

    c.signal(signal.SIGSTOP)
    t0 = time.monotonic()
    wait_for(lambda: old_id not in ctl.members(), hb + 5, "the stopped replica to be evicted")
    print(f"SIGSTOPped replica evicted after {time.monotonic() - t0:.2f} s (heartbeat_s={hb})")
    assert ctl.evictions(old_id)[-1]["reason"] == "heartbeat timeout"
    for n in "ab":
        reps[n].wait_line(
            lambda x: old_id not in x["members"], 10, "a quorum without c", after=marks[n]
        )

    c.signal(signal.SIGCONT)
    line = c.wait_line(
        lambda x: x["replica_id"] != old_id and names(x["members"]) == {"a", "b", "c"},
        20,
        "a quorum of a, b, c as a new incarnation",
    )
    new_id = line["replica_id"]
    assert new_id.startswith("c:") and line["incarnation"] == 2
    for n in "ab":
        reps[n].wait_line(lambda x: new_id in x["members"], 10, "a quorum with the new c")
    assert new_id in ctl.members() and old_id not in ctl.members()
    assert "registering a new incarnation" in c.err.read_text()

    # `phalanx status --json` (the documented machine-readable form) tells the two
    # incarnations of c apart: the old one evicted by the heartbeat detector, the new
    # one live in the quorum.
    policy = cli_status(ctl.state_dir)["overview"]["roles"]["policy"]
    live = {r["replica_id"]: r for r in policy["replicas"]}
    assert live[new_id]["name"] == "c" and live[new_id]["state"] in ("active", "healing")
    assert live[new_id]["incarnation"] == new_id.rpartition(":")[2] != old_id.rpartition(":")[2]
    assert old_id not in live
    (gone,) = [e for e in policy["evicted"] if e["replica_id"] == old_id]
    assert (gone["state"], gone["detector"]) == ("evicted", "heartbeat")

    check_rounds([r.lines() for r in reps.values()])

"""The controller's durability: SIGKILLed and restarted mid-run on the same state
dir it loses nothing and the replicas carry on; a second controller on the
same state dir is refused."""

from __future__ import annotations

import signal
import time

from procs import check_rounds, names


def test_controller_sigkill_and_restart_loses_nothing(start_controller, start_replica):
    # No replica may be evicted here, not even one stalled by a loaded machine.
    ctl = start_controller(n_init=3, heartbeat_s=10.0)
    reps = {n: start_replica(ctl, n) for n in "abc"}
    for r in reps.values():
        r.wait_line(lambda x: names(x["members"]) == {"a", "b", "c"}, 30, "a quorum of a, b, c")
        r.wait_line(lambda x: x["step"] >= 5, 30, "a few steps")
    ids = {n: r.replica_id() for n, r in reps.items()}

    ckpt = {"kind": "checkpoint", "payload": {"path": "file:///ckpt/7", "step": 7}}
    assert ctl.post("/v1/commands", {"target": ids["a"], **ckpt}).status_code == 200
    sync = {"kind": "sync_weights", "payload": {"version": 3}}
    assert ctl.post("/v1/commands", {"target": "policy", **sync}).status_code == 200
    before = ctl.status()
    url = ctl.url

    ctl.kill(signal.SIGKILL)
    time.sleep(0.5)  # the replicas keep retrying meanwhile
    marks = {n: len(r.lines()) for n, r in reps.items()}
    ctl.start()
    assert ctl.url == url, "a restarted controller must come back on its previous port"

    after = ctl.status()
    assert after["epoch"] == before["epoch"] + 1
    pb, pa = before["roles"]["policy"], after["roles"]["policy"]
    assert sorted(m["replica_id"] for m in pa["replicas"]) == sorted(ids.values())
    for key in ("quorum_id", "round", "step"):
        assert pa[key] >= pb[key], (key, pb[key], pa[key])
    pending = {m["replica_id"]: m["commands_pending"] for m in pa["replicas"]}
    assert pending == {ids["a"]: 2, ids["b"]: 1, ids["c"]: 1}
    r = ctl.post("/v1/commands/poll", {"replica_id": ids["a"], "wait_s": 0})
    got = [{"kind": c["kind"], "payload": c["payload"]} for c in r.json()["commands"]]
    assert got == [ckpt, sync]

    # The replicas re-attach by themselves and carry on, several steps further.
    for n, r in reps.items():
        first = r.wait_line(lambda x: x["epoch"] == after["epoch"], 30, "a quorum after restart")
        r.wait_line(lambda x, s=first["step"]: x["step"] >= s + 5, 30, "more steps", marks[n])
        assert "controller restarted (epoch 1 -> 2)" in r.err.read_text()
    rounds = check_rounds([r.lines() for r in reps.values()])
    # Every quorum ever formed was seen (none lost across the restart), each
    # training the next step.
    assert sorted(rounds) == list(range(1, max(rounds) + 1))
    for rid in ids.values():
        assert ctl.evictions(rid) == []


def test_second_controller_on_the_same_state_dir_is_refused(start_controller):
    ctl = start_controller()
    url_file = (ctl.state_dir / "url").read_text()

    proc, _, err = ctl.launch()
    assert proc.wait(timeout=30) != 0
    msg = err.read_text()
    assert "must be used by one controller at a time" in msg, msg
    assert f"held by another controller (pid {ctl.pid}" in msg, msg
    assert "Traceback" not in msg, msg

    # The first controller is untouched and still serving.
    assert (ctl.state_dir / "url").read_text() == url_file
    assert (ctl.state_dir / "token").read_text().strip() == ctl.token
    assert ctl.get("/healthz").status_code == 200
    assert ctl.status()["epoch"] == 1

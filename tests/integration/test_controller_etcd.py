"""A controller on an etcd journal: SIGKILLed and started again on a *fresh, empty*
state dir (its host lost), it resumes from etcd with nothing lost; an etcd that stops
answering (SIGSTOP) makes the requests that need a journal write 503, with the reason
in the status, and the job carries on when etcd runs again."""

from __future__ import annotations

import shutil
import signal
import time
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from etcd_server import Cluster, etcd  # noqa: F401  (etcd: a module-scoped fixture)
from procs import (
    FAST_TIMEOUTS,
    Controller,
    check_rounds,
    child_env,
    cli_status,
    names,
    signal_group,
    wait_for,
    write_job_toml,
)

from phalanx import env
from phalanx.controller.journal.leader import LEASE_TTL_S

START_S = 120.0
"""Bound on a controller's start on a loaded machine (a restart also waits up to a
lease TTL for its dead predecessor's leader key to lapse)."""


class Job:
    """One job on its own etcd prefix, and its controllers: each on a state dir of its
    own (a host), all with the job's token."""

    def __init__(self, cluster: Cluster, procs: Any, tmp: Path, n_init: int, job: str = ""):
        self.id = job or f"etcd-{uuid.uuid4().hex[:8]}"
        self.procs, self.tmp, self.token = procs, tmp, uuid.uuid4().hex
        self.config = write_job_toml(
            tmp / "job.toml",
            {
                "job": {"id": self.id},
                "timeouts": {**FAST_TIMEOUTS, "heartbeat_s": 10.0},
                "controller": {"tick_s": 0.02, "journal": cluster.url(f"/{self.id}")},
                "roles.policy": {
                    "min_replicas": 1,
                    "n_init_replicas": n_init,
                    "join_timeout_s": 0.5,
                },
            },
        )

    def start(self, host: str, port: int = 0) -> Controller:
        """A controller on ``host``, once it leads (one started while another's leader
        key is still there stands by until it takes over)."""
        ctl_env = {**child_env(), env.TOKEN: self.token}
        args = ["--port", str(port)] if port else []
        ctl = Controller(self.procs, self.tmp / host, self.config, args=args, env=ctl_env)
        ctl.start(timeout=START_S)
        wait_for(lambda: ctl.get("/healthz").json()["role"] == "leader", START_S, "it to lead")
        return ctl


def test_a_controller_restarted_on_a_fresh_state_dir_resumes_from_etcd(
    etcd,  # noqa: F811
    procs,
    start_replica,
    tmp_path: Path,
):
    job = Job(etcd, procs, tmp_path, 3)
    ctl = job.start("host1")
    assert ctl.status()["journal"] == {
        "kind": "etcd",
        "where": ctl.status()["journal"]["where"],
        "healthy": True,
        "error": "",
        "unavailable_since": None,
        "unjournaled": 0,
        "term": 1,
    }
    # The replicas find the controller at one address (as behind a service name): the
    # first host's url file, which the restarted one on the same port keeps true.
    reps = {n: start_replica(ctl, n) for n in "abc"}
    for r in reps.values():
        r.wait_line(lambda x: names(x["members"]) == {"a", "b", "c"}, 240, "a quorum of a, b, c")
        r.wait_line(lambda x: x["step"] >= 5, 60, "a few steps")
    ids = {n: r.replica_id() for n, r in reps.items()}
    ckpt = {"kind": "checkpoint", "payload": {"path": "file:///ckpt/7", "step": 7}}
    assert ctl.post("/v1/commands", {"target": ids["a"], **ckpt}).status_code == 200
    before = ctl.status()

    ctl.kill(signal.SIGKILL)
    marks = {n: len(r.lines()) for n, r in reps.items()}
    port = urlsplit(ctl.url).port
    assert port
    again = job.start("host2", port)
    assert not (tmp_path / "host2" / "journal.sqlite").exists()

    after = again.status()
    assert after["epoch"] == before["epoch"] + 1
    assert after["journal"]["term"] == 2 and after["journal"]["healthy"]
    pb, pa = before["roles"]["policy"], after["roles"]["policy"]
    assert sorted(m["replica_id"] for m in pa["replicas"]) == sorted(ids.values())
    for key in ("quorum_id", "round", "step"):
        assert pa[key] >= pb[key], (key, pb[key], pa[key])
    r = again.post("/v1/commands/poll", {"replica_id": ids["a"], "wait_s": 0})
    got = [{"kind": c["kind"], "payload": c["payload"]} for c in r.json()["commands"]]
    assert got == [ckpt]
    for n, rep in reps.items():
        first = rep.wait_line(lambda x: x["epoch"] == after["epoch"], 120, "a quorum after restart")
        rep.wait_line(lambda x, s=first["step"]: x["step"] >= s + 5, 60, "more steps", marks[n])
    rounds = check_rounds([rep.lines() for rep in reps.values()])
    assert sorted(rounds) == list(range(1, max(rounds) + 1)), "no quorum lost or formed twice"
    for rid in ids.values():
        assert again.evictions(rid) == []


def test_a_stopped_etcd_gets_503s_with_the_reason_and_the_job_resumes_without_loss(
    etcd,  # noqa: F811
    procs,
    start_replica,
    tmp_path: Path,
):
    job = Job(etcd, procs, tmp_path, 2)
    ctl = job.start("host1")
    reps = {n: start_replica(ctl, n) for n in "ab"}
    for r in reps.values():
        r.wait_line(lambda x: x["step"] >= 3, 240, "a few steps")
    sync = {"kind": "sync_weights", "payload": {"version": 1}}

    etcd.member.signal(signal.SIGSTOP)
    try:
        # The replicas' own steps hit the stopped etcd at once; an operator's request
        # that needs a journal write is refused, in one line that says why.
        r = ctl.post("/v1/commands", {"target": "policy", **sync})
        assert r.status_code == 503, r.text
        msg = r.json()["error"]
        assert msg.startswith(f"journal etcd://127.0.0.1:{etcd.member.client}/{job.id} "), msg
        assert "is unavailable (etcd at 127.0.0.1:" in msg and "retry it" in msg, msg
        assert "\n" not in msg
        j = ctl.status()["journal"]
        assert j["healthy"] is False and j["unjournaled"] > 0 and j["unavailable_since"]
        assert "did not answer" in j["error"], j
        assert cli_status(ctl.state_dir)["journal"]["healthy"] is False  # `phalanx status`
        stalled = {n: len(r.lines()) for n, r in reps.items()}
        # Past the leader key's lease: etcd may expire it as it comes back (the
        # controller then takes its key again, in the same term).
        time.sleep(LEASE_TTL_S + 1)
        assert {n: len(r.lines()) for n, r in reps.items()} == stalled, "no quorum while down"
    finally:
        etcd.member.signal(signal.SIGCONT)

    # Healthy again once everything held was written. The replicas step on meanwhile, so
    # a status may catch their newest changes in flight: wait for a moment with none.
    def drained() -> bool:
        j = ctl.status()["journal"]
        return bool(j["healthy"]) and j["unjournaled"] == 0

    wait_for(drained, 60, "the journal to answer again and write what it held")
    j = ctl.status()["journal"]
    assert j["healthy"] and j["term"] == 1 and j["error"], j  # the last error stays
    for n, rep in reps.items():
        rep.wait_line(lambda x: x["step"] >= 5, 120, "steps after etcd came back", stalled[n])
    assert ctl.post("/v1/commands", {"target": "policy", **sync}).status_code == 200
    before = ctl.status()["roles"]["policy"]

    # What was acknowledged is in etcd: a controller on another host finds all of it.
    port = urlsplit(ctl.url).port
    assert port
    ctl.kill(signal.SIGKILL)
    again = job.start("host2", port)
    after = again.status()["roles"]["policy"]
    assert after["step"] >= before["step"] and after["quorum_id"] >= before["quorum_id"]
    # The members the old controller acknowledged last (a replica evicted under load
    # while etcd was stopped comes back as a new incarnation: that one).
    assert sorted(m["replica_id"] for m in after["replicas"]) == sorted(
        m["replica_id"] for m in before["replicas"]
    )
    for m in after["replicas"]:
        assert m["commands_pending"] >= 1, m  # the sync order acknowledged above
    rounds = check_rounds([rep.lines() for rep in reps.values()])
    assert sorted(rounds) == list(range(1, max(rounds) + 1))


def test_a_leader_woken_from_sigstop_after_a_takeover_stops_and_exits_in_one_line(
    etcd,  # noqa: F811
    procs,
    tmp_path: Path,
):
    job = Job(etcd, procs, tmp_path, 1)
    old = job.start("host1")
    order = {"target": "policy", "kind": "sync_weights", "payload": {"version": 1}}
    assert old.post("/v1/commands", order).status_code == 200
    assert old.proc is not None and old.err is not None
    signal_group(old.proc, signal.SIGSTOP)
    # It believes it leads; its lease lapses, and a controller on another host takes over.
    new = job.start("host2")
    assert new.status()["journal"]["term"] == 2
    signal_group(old.proc, signal.SIGCONT)
    rc = old.proc.wait(timeout=60)
    err = old.err.read_text()
    assert rc == 1, err
    assert f"this controller (term 1) no longer leads job '{job.id}': the " in err, err
    assert f"the controller at {new.url} (term 2, since " in err, err
    assert "Traceback" not in err, err
    # The new leader was never fenced out by the old one.
    assert new.post("/v1/commands", order).status_code == 200
    j = new.status()["journal"]
    assert j["healthy"] and j["term"] == 2


def test_a_job_moved_from_sqlite_to_etcd_keeps_its_state(
    etcd,  # noqa: F811
    procs,
    start_replica,
    tmp_path: Path,
):
    """A job run on the SQLite journal, its controller then started on the same state
    dir with an etcd journal: the SQLite journal is carried over into the empty prefix
    (and set aside), and the job goes on from where it was. Started again with a stray
    ``journal.sqlite`` there, the etcd journal is the job's: the file is not read."""
    job_id = f"moved-{uuid.uuid4().hex[:8]}"

    def config(journal: str, name: str) -> Path:
        return write_job_toml(
            tmp_path / name,
            {
                "job": {"id": job_id},
                "timeouts": {**FAST_TIMEOUTS, "heartbeat_s": 10.0},
                "controller": {"tick_s": 0.02, "journal": journal},
                "roles.policy": {"min_replicas": 1, "n_init_replicas": 2},
            },
        )

    state = tmp_path / "host1"
    lite = Controller(procs, state, config("sqlite", "lite.toml")).start(timeout=START_S)
    reps = {n: start_replica(lite, n) for n in "ab"}
    for r in reps.values():
        r.wait_line(lambda x: x["step"] >= 5, 240, "a few steps on SQLite")
    ids = sorted(r.replica_id() or "" for r in reps.values())
    lite.kill(signal.SIGTERM)
    before_step = max(r.last()["step"] for r in reps.values())  # type: ignore[index]
    port = urlsplit(lite.url).port
    etcd_config = config(etcd.url(f"/{job_id}"), "etcd.toml")
    ctl = Controller(procs, state, etcd_config, args=["--port", str(port)]).start(timeout=START_S)
    assert ctl.err is not None
    err = ctl.err.read_text()
    assert "carried the SQLite journal" in err and "journal.sqlite.moved-to-etcd" in err, err
    assert (state / "journal.sqlite.moved-to-etcd").exists()
    assert not (state / "journal.sqlite").exists()
    after = ctl.status()
    assert after["journal"]["kind"] == "etcd" and after["epoch"] == 2, after["journal"]
    policy = after["roles"]["policy"]
    assert sorted(m["replica_id"] for m in policy["replicas"]) == ids
    assert policy["step"] >= before_step - 1  # (a step may have committed after the last line)
    for r in reps.values():
        first = r.wait_line(lambda x: x["epoch"] == 2, 120, "a quorum under the etcd journal")
        r.wait_line(lambda x, s=first["step"]: x["step"] >= s + 3, 60, "steps on etcd")
    check_rounds([r.lines() for r in reps.values()])

    ctl.kill(signal.SIGKILL)
    shutil.copy(state / "journal.sqlite.moved-to-etcd", state / "journal.sqlite")
    again = Controller(procs, state, etcd_config, args=["--port", str(port)])
    again.start(timeout=START_S)
    wait_for(lambda: again.get("/healthz").json()["role"] == "leader", START_S, "it to lead")
    assert again.err is not None
    assert "which was not read: etcd journal" in again.err.read_text()
    assert (state / "journal.sqlite").exists()
    assert again.status()["epoch"] == 3

"""Several controllers of one job on one etcd prefix: one leads, the others stand by
(421 with the leader's URL) and one takes over when the leader is SIGKILLed or
stopped past its lease. Replicas are given every controller's URL and follow the
leader; the job goes on with no quorum formed twice, no step going back and nobody
evicted for the failover."""

from __future__ import annotations

import random
import signal
import uuid
from pathlib import Path
from typing import Any

import httpx
from etcd_server import Cluster, etcd  # noqa: F401  (etcd: a module-scoped fixture)
from procs import (
    FAST_TIMEOUTS,
    Controller,
    Replica,
    check_rounds,
    child_env,
    signal_group,
    wait_for,
    write_job_toml,
)

from phalanx import env
from phalanx.client import ControllerClient

START_S = 120.0
"""Bound on a controller's start on a loaded machine."""


class Job:
    """One job on its own etcd prefix and its controllers, each on a state dir of its
    own (a host), all given the job's token."""

    def __init__(self, cluster: Cluster, procs: Any, tmp: Path, n_init: int):
        self.id = f"standby-{uuid.uuid4().hex[:8]}"
        self.procs, self.tmp, self.token = procs, tmp, uuid.uuid4().hex
        self.env = {**child_env(), env.TOKEN: self.token}
        self.config = write_job_toml(
            tmp / "job.toml",
            {
                "job": {"id": self.id},
                "timeouts": {**FAST_TIMEOUTS, "heartbeat_s": 10.0},
                "controller": {"tick_s": 0.02, "journal": cluster.url(f"/{self.id}")},
                "roles.policy": {"min_replicas": 1, "n_init_replicas": n_init},
            },
        )
        self.controllers: list[Controller] = []

    def start(self, host: str) -> Controller:
        ctl = Controller(self.procs, self.tmp / host, self.config, env=self.env)
        self.controllers.append(ctl.start(timeout=START_S))
        return ctl

    @property
    def urls(self) -> str:
        return ",".join(c.url for c in self.controllers)

    def replica(self, name: str, urls: str = "") -> Replica:
        return Replica(self.procs, urls or self.urls, name, 0.05, self.env)

    def leader(self, other_than: Controller | None = None) -> Controller:
        """The controller that leads (waits for one, other than ``other_than``)."""

        def find() -> Controller | None:
            for c in self.controllers:
                if c is other_than or c.proc is None or c.proc.poll() is not None:
                    continue
                try:
                    if c.get("/healthz").json().get("role") == "leader":
                        return c
                except httpx.HTTPError:
                    continue
            return None

        return wait_for(find, 60, "a controller to lead")


def quorums_agree(reps: list[Replica]) -> None:
    """Every quorum any replica received: one member set per quorum id."""
    seen: dict[int, list[str]] = {}
    for r in reps:
        for line in r.lines():
            members = seen.setdefault(line["quorum_id"], line["members"])
            assert members == line["members"], (line["quorum_id"], members, line["members"])


def test_a_standby_takes_over_from_a_sigkilled_leader_and_the_job_goes_on(
    etcd,  # noqa: F811
    procs,
    tmp_path: Path,
):
    job = Job(etcd, procs, tmp_path, 3)
    first = job.start("host1")
    for h in ("host2", "host3"):
        job.start(h)
    standby = job.controllers[1]
    health = standby.get("/healthz").json()
    assert health["role"] == "standby" and health["leader"] == first.url, health
    r = standby.post("/v1/commands", {"target": "policy", "kind": "x", "payload": {}})
    assert r.status_code == 421 and r.json()["leader"] == first.url, r.text
    assert "\n" not in r.json()["error"]
    hb = standby.post("/v1/heartbeat", {"replica_id": "x", "step": 0})  # a hot route too
    assert hb.status_code == 421 and hb.json()["leader"] == first.url, hb.text
    page = httpx.get(standby.url + "/", timeout=10)  # a browser's: sent to the leader's page
    assert page.status_code == 307 and page.headers["location"] == first.url + "/", page
    st = first.status()["controllers"]
    assert st["leader"] == first.url and st["term"] == 1 and st["failovers"] == 0
    wait_for(lambda: len(first.status()["controllers"]["standbys"]) == 2, 30, "two standbys listed")

    reps = [job.replica(n) for n in "abc"]
    for rep in reps:
        rep.wait_line(lambda x: x["step"] >= 3, 240, "a few steps")
    ids = [rep.replica_id() for rep in reps]
    rng = random.Random(36)
    leader = first
    for failover in (1, 2):
        # A seeded moment in the job: some steps after the last failover.
        target = max(rep.last()["step"] for rep in reps) + rng.randint(2, 8)  # type: ignore[index]
        reps[0].wait_line(lambda x, t=target: x["step"] >= t, 120, "steps before the kill")
        leader.kill(signal.SIGKILL)
        new = job.leader(other_than=leader)
        assert new.status()["controllers"]["failovers"] == failover
        marks = [len(rep.lines()) for rep in reps]
        after = max(rep.last()["step"] for rep in reps)  # type: ignore[index]
        for rep, mark in zip(reps, marks, strict=True):
            rep.wait_line(lambda x, s=after: x["step"] >= s + 5, 120, "steps after", mark)
        leader = new
    check_rounds([rep.lines() for rep in reps])  # steps and rounds never go backwards
    quorums_agree(reps)
    for rid in ids:
        assert rid is not None and leader.evictions(rid) == [], rid
    assert {rep.replica_id() for rep in reps} == set(ids), "no replica re-registered"


def test_a_leader_stopped_past_its_lease_does_not_act_when_it_wakes(
    etcd,  # noqa: F811
    procs,
    tmp_path: Path,
):
    job = Job(etcd, procs, tmp_path, 2)
    old = job.start("host1")
    job.start("host2")
    reps = [job.replica(n) for n in "ab"]
    for rep in reps:
        rep.wait_line(lambda x: x["step"] >= 3, 240, "a few steps")
    assert old.proc is not None and old.err is not None
    signal_group(old.proc, signal.SIGSTOP)
    new = job.leader(other_than=old)  # its lease lapsed: the standby took over
    marks = [len(rep.lines()) for rep in reps]
    after = max(rep.last()["step"] for rep in reps)  # type: ignore[index]
    for rep, mark in zip(reps, marks, strict=True):
        rep.wait_line(lambda x, s=after: x["step"] >= s + 3, 120, "steps under the new", mark)
    writes = new.status()["journal"]
    signal_group(old.proc, signal.SIGCONT)
    # Woken, it answers nothing with an effect (fenced at once), and exits in one line.
    try:
        r = old.post("/v1/heartbeat", {"replica_id": reps[0].replica_id(), "step": 0})
        assert r.status_code in (503, 421), r.text
    except httpx.HTTPError:
        pass  # already gone
    rc = old.proc.wait(timeout=60)
    err = old.err.read_text()
    assert rc == 1 and "no longer leads job" in err and "Traceback" not in err, err
    assert new.status()["journal"]["term"] == writes["term"] == 2
    for rep in reps:
        rep.wait_line(lambda x, s=after: x["step"] >= s + 6, 120, "steps after the wake")
    check_rounds([rep.lines() for rep in reps])
    quorums_agree(reps)


def test_a_client_given_only_a_standbys_url_finds_the_leader(
    etcd,  # noqa: F811
    procs,
    tmp_path: Path,
):
    job = Job(etcd, procs, tmp_path, 1)
    leader = job.start("host1")
    standby = job.start("host2")
    c = ControllerClient(standby.url, "policy", "a", token=job.token)
    try:
        c.register()
        q = c.quorum(step=0, timeout_s=30)
        assert q.replica_ids == [c.replica_id]
        assert c.url == leader.url
    finally:
        c.close()

"""Jepsen-style runs of the standby controllers (issue 36) on namespace hosts: three
controllers on c1..c3 and a three-member etcd cluster on e1..e3, each on a host of its
own, the job's replicas on r1 and r2. While an FT job or an RL job runs, faults come
one after another, in an order and at moments drawn from a seed:

- ``kill_leader``: SIGKILL the leading controller;
- ``stop_leader``: SIGSTOP it past its lease, then SIGCONT: it must not act (it is
  fenced, and exits in one line);
- ``cut_leader``: cut the leader from every etcd host, not from the replicas;
- ``cut_standby``: cut a standby from every other host;
- ``kill_etcd``: SIGKILL one etcd member.

After each fault the job must go on under a leader; whatever went is then brought back
as its supervisor would (a controller restarted on its state dir, where it stands by;
the etcd member on its data dir), so the next fault meets three of each. After the run:

- the job finishes;
- steps never go back (within an incarnation of a replica);
- no quorum id is ever issued with two member sets: every committed step of a quorum
  was printed by the same replicas, as many as its participants;
- FT: the committed global batches are the sampler's stream, which is what a calm run
  commits (the product audit's ``data.samples``), and every replica ends with the same state;
- RL: the ledger balances, and no rollout or prompt is trained twice.

The default run has each fault once for the FT job and two for the RL job; the
``slow`` runs repeat every fault alone with several seeds, for both jobs.

Root only (the namespaces) and etcd; skipped with the reason otherwise.
"""

from __future__ import annotations

import random
import signal
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from etcd_server import ETCD, MISSING, Cluster, start_cluster
from ftjob import TIMEOUTS as FT_TIMEOUTS
from ftjob import TRAIN, FTJob, assert_identical, audit_outputs, step_lines
from procs import PROGRESS_S, Controller, Procs, child_env, signal_group, wait_for, write_job_toml
from test_rl import RLReplica, job_sections, trained_prompts, wait_finished

from phalanx import env
from phalanx.testing import netns

REASON = netns.unavailable() or (None if ETCD else MISSING)
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

CONTROLLERS = ("c1", "c2", "c3")
ETCDS = ("e1", "e2", "e3")
PORT = 7411
"""Every controller listens on this port of its own host: one restarted on its state
dir is where the replicas' URL list says."""
START_S = 120.0
"""Bound on a controller's start on a loaded machine."""
FAULTS = ("kill_leader", "stop_leader", "cut_leader", "cut_standby", "kill_etcd")
SEED = 7
TIMEOUTS = {"heartbeat_s": 10.0, "collective_s": 5.0, "suspect_grace_s": 0.5}
"""Generous failure detection: the replicas are not under test, the controllers are (a
quorum call that straddles a failover enters its allreduce late by the failover)."""


@dataclass
class World:
    net: netns.Net
    hosts: dict[str, netns.Host]
    etcd: Cluster


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    """The hosts and the etcd cluster, shared by the module's tests (each job keeps to
    a key prefix of its own); removed at the end, even after a failure."""
    net = netns.Net()
    cluster: Cluster | None = None
    try:
        for name in (*CONTROLLERS, *ETCDS, "r1", "r2"):
            net.add_host(name)
        net.watch_from_here()
        hosts = net.hosts
        cluster = start_cluster(tmp_path_factory.mktemp("etcd"), 3, [hosts[e] for e in ETCDS])
        yield World(net, hosts, cluster)
    finally:
        if cluster is not None:
            cluster.stop()
        net.close()


class Controllers:
    """One job's three controllers, on c1..c3, on the job's etcd prefix."""

    def __init__(self, world: World, procs: Procs, tmp: Path, config: Path, token: str):
        self.world = world
        self.env = {**child_env(), env.TOKEN: token}
        self.by_host = {
            h: Controller(
                procs, tmp / h, config, ["--port", str(PORT)], env=self.env, host=world.hosts[h]
            )
            for h in CONTROLLERS
        }
        self.urls = ",".join(f"http://{world.hosts[h].ip}:{PORT}" for h in CONTROLLERS)

    def start(self) -> None:
        for c in self.by_host.values():
            c.start(timeout=START_S)

    def host_of(self, c: Controller) -> netns.Host:
        return self.world.hosts[next(h for h, x in self.by_host.items() if x is c)]

    def role(self, c: Controller) -> str | None:
        if c.proc is None or c.proc.poll() is not None:
            return None
        try:
            return str(c.get("/healthz").json().get("role"))
        except (httpx.HTTPError, ValueError):
            return None

    def leader(self, other_than: Controller | None = None) -> Controller:
        """The controller that leads (waits for one, other than ``other_than``)."""

        def find() -> Controller | None:
            return next(
                (
                    c
                    for c in self.by_host.values()
                    if c is not other_than and self.role(c) == "leader"
                ),
                None,
            )

        return wait_for(find, PROGRESS_S, "a controller to lead")

    def standbys(self) -> list[Controller]:
        return [c for c in self.by_host.values() if self.role(c) == "standby"]

    def status(self) -> dict[str, Any]:
        """The leader's ``/v1/status`` (whichever leads now)."""
        return self.leader().status()

    def revive(self, c: Controller) -> None:
        """``c``, which went (killed, or deposed: then it said why in one line), started
        again on its state dir, where it stands by."""
        assert c.proc is not None and c.err is not None
        rc = c.proc.wait(timeout=PROGRESS_S)
        err = c.err.read_text()
        if rc != -signal.SIGKILL:
            assert rc == 1 and "no longer leads" in err and "Traceback" not in err, (rc, err)
        c.start(timeout=START_S)
        wait_for(
            lambda: self.role(c) == "standby", PROGRESS_S, "the revived controller to stand by"
        )


@dataclass
class Run:
    """A job under faults: its controllers and how to see it progress."""

    world: World
    ctls: Controllers
    progress: Callable[[], int]
    """A count that grows while the job trains (committed steps)."""
    finished: Callable[[], bool]

    def goes_on(self, what: str, by: int = 3) -> None:
        at = self.progress()
        assert not self.finished(), f"the job ended before {what}: lengthen it"
        wait_for(lambda: self.progress() >= at + by, PROGRESS_S, f"the job to go on after {what}")


def kill_leader(run: Run, rng: random.Random) -> None:
    old = run.ctls.leader()
    old.kill(signal.SIGKILL)
    run.ctls.leader(other_than=old)
    run.goes_on("the leader's SIGKILL")
    run.ctls.revive(old)


def stop_leader(run: Run, rng: random.Random) -> None:
    old = run.ctls.leader()
    assert old.proc is not None
    signal_group(old.proc, signal.SIGSTOP)
    new = run.ctls.leader(other_than=old)  # its lease lapsed: a standby took over
    run.goes_on("the leader's SIGSTOP")
    term = new.status()["controllers"]["term"]
    signal_group(old.proc, signal.SIGCONT)
    # Woken, it is fenced at once: it exits in one line (revive checks it).
    run.ctls.revive(old)
    run.goes_on("the stopped leader's wake")
    assert run.ctls.leader() is new and new.status()["controllers"]["term"] == term


def cut_leader(run: Run, rng: random.Random) -> None:
    old = run.ctls.leader()
    h = run.ctls.host_of(old)
    net = run.world.net
    try:
        net.cut(h, [run.world.hosts[e] for e in ETCDS])
        run.ctls.leader(other_than=old)
        run.goes_on("the leader's cut from etcd")
    finally:
        net.heal(h)
    # Healed, it finds itself deposed and exits in one line.
    run.ctls.revive(old)


def cut_standby(run: Run, rng: random.Random) -> None:
    standby = rng.choice(run.ctls.standbys())
    h = run.ctls.host_of(standby)
    net = run.world.net
    try:
        net.cut(h, [x for x in run.world.hosts.values() if x is not h])
        run.goes_on("a standby's cut")
    finally:
        net.heal(h)
    if standby.proc is not None and standby.proc.poll() is not None:
        run.ctls.revive(standby)
    wait_for(
        lambda: run.ctls.role(standby) == "standby", PROGRESS_S, "the standby to stand by again"
    )


def kill_etcd(run: Run, rng: random.Random) -> None:
    m = rng.choice(run.world.etcd.members)
    m.signal(signal.SIGKILL)
    assert m.proc is not None
    m.proc.wait(timeout=10)
    run.goes_on("an etcd member's SIGKILL")
    m.start(run.world.etcd.spec)
    run.world.etcd.wait_healthy()


FAULT_FNS = {f.__name__: f for f in (kill_leader, stop_leader, cut_leader, cut_standby, kill_etcd)}


def inject(run: Run, faults: list[str], seed: int) -> None:
    """``faults`` in turn, each after a seeded number of steps."""
    rng = random.Random(seed)
    for name in faults:
        run.goes_on(f"the wait before {name}", by=rng.randint(2, 6))
        FAULT_FNS[name](run, rng)


def check_quorums(lines: dict[int, dict[str, dict[str, Any]]]) -> None:
    """No quorum id with two member sets, in every step line of every replica."""
    members: dict[int, set[str]] = {}
    for step, by_id in lines.items():
        for e in by_id.values():
            seen = members.setdefault(e["quorum_id"], set(by_id))
            assert seen == set(by_id), (f"quorum {e['quorum_id']} at step {step}", seen, by_id)


def check_controllers(ctls: Controllers, faults: list[str]) -> None:
    """A failover for each fault that took the leader, and no controller's stderr with
    a traceback."""
    took = sum(f in ("kill_leader", "stop_leader", "cut_leader") for f in faults)
    assert ctls.status()["controllers"]["failovers"] >= took
    for c in ctls.by_host.values():
        assert c.err is not None and "Traceback" not in c.err.read_text(), c.err.read_text()


# -- the FT job ----------------------------------------------------------------


def ft_run(world: World, procs: Procs, tmp: Path, faults: list[str], seed: int, steps: int) -> None:
    job_id = f"jepsen-ft-{uuid.uuid4().hex[:6]}"
    sections = {
        "job": {"id": job_id, "seed": SEED},
        "timeouts": {**FT_TIMEOUTS, **TIMEOUTS},
        "controller": {"tick_s": 0.02, "journal": world.etcd.url("/" + job_id)},
        "roles.policy": {"min_replicas": 1, "n_init_replicas": 2, "join_timeout_s": 0.5},
        "train": {**TRAIN, "steps": steps, "step_delay_s": 0.05},
    }
    config = write_job_toml(tmp / "job.toml", sections)
    ctls = Controllers(world, procs, tmp, config, uuid.uuid4().hex)
    ctls.start()
    job = FTJob(tmp, config)
    try:
        reps = [
            job.start_replica(h, "--controller", ctls.urls, host=world.hosts[h], env=ctls.env)
            for h in ("r1", "r2")
        ]

        def progress() -> int:
            return min((s["step"] for r in reps for s in r.steps()[-1:]), default=0)

        run = Run(world, ctls, progress, lambda: any(r.done for r in reps))
        wait_for(lambda: progress() >= 3, PROGRESS_S, "both replicas to commit")
        inject(run, faults, seed)
        finals = [r.finish() for r in reps]
    finally:
        job.cleanup(exit_grace_s=30)
    # The product audit (steps once, in order, complete; the sampler's batches), from
    # the state dir of a controller that led (its config.json) and the replicas'
    # outputs; the journal is in etcd, out of its sight.
    led = [c.state_dir for c in ctls.by_host.values() if (c.state_dir / "config.json").is_file()]
    assert led, "no controller wrote the job's config.json"
    audit_outputs(led[0], [r.out_path for r in reps], steps)
    check_quorums(step_lines(reps))
    assert_identical(finals)
    check_controllers(ctls, faults)


def test_the_ft_job_commits_every_batch_once_through_every_fault(
    world: World, procs: Procs, tmp_path: Path
) -> None:
    ft_run(world, procs, tmp_path, list(FAULTS), seed=36, steps=260)


# -- the RL job ----------------------------------------------------------------


def rl_run(world: World, procs: Procs, tmp: Path, faults: list[str], seed: int, steps: int) -> None:
    job_id = f"jepsen-rl-{uuid.uuid4().hex[:6]}"
    sections = job_sections(steps=steps, target_reward=0.99)
    sections["job"]["id"] = job_id
    sections["timeouts"].update(TIMEOUTS)
    sections["controller"]["journal"] = world.etcd.url("/" + job_id)
    # Rollout payloads outside the controller (its payload log would not survive a
    # takeover on another host: a standby of an RL job refuses to start without).
    sections["rl.transport"] = {"rollouts": f"file://{tmp / 'rollouts'}"}
    sections["rl.loop"]["gen_delay_s"] = 0.05
    config = write_job_toml(tmp / "rl.toml", sections)
    ctls = Controllers(world, procs, tmp, config, uuid.uuid4().hex)
    ctls.start()
    some = ctls.by_host["c1"]
    extra = ("--controller", ctls.urls)
    policy = RLReplica(
        procs, some, config, "policy", "policy-0", *extra, host=world.hosts["r1"], env=ctls.env
    )
    roll = RLReplica(
        procs, some, config, "rollout", "rollout-0", *extra, host=world.hosts["r2"], env=ctls.env
    )

    def progress() -> int:
        return max((e["step"] for e in policy.events("step")), default=0)

    def finished() -> bool:
        return bool(policy.events("done")) or policy.proc.poll() is not None

    run = Run(world, ctls, progress, finished)
    wait_for(lambda: progress() >= 2, PROGRESS_S, "the policy to train")
    inject(run, faults, seed)

    class Leading:
        def status(self) -> dict[str, Any]:
            return ctls.status()

    st = wait_finished(Leading(), [policy, roll], timeout=PROGRESS_S)  # type: ignore[arg-type]
    # The ledger lives in etcd, out of the product audit's sight (it reads a SQLite
    # journal): checked on the live controllers' books and the policy's lines.
    prompts = trained_prompts([policy])
    assert st["ok"], f"ledger does not balance: {st}"
    assert len(prompts) == len(set(prompts)), "a prompt was trained twice"
    assert st["prompts"]["trained"] == len(prompts) == st["rollouts"]["trained"], st
    steps_seen = [e["step"] for e in policy.events("step")]
    assert steps_seen == sorted(set(steps_seen)), "a policy step went back or repeated"
    quorums: dict[int, int] = {}
    for e in policy.events("step"):
        assert quorums.setdefault(e["quorum_id"], e["participants"]) == e["participants"], e
    check_controllers(ctls, faults)


def test_the_rl_job_trains_every_prompt_once_across_failovers(
    world: World, procs: Procs, tmp_path: Path
) -> None:
    rl_run(world, procs, tmp_path, ["kill_leader", "cut_leader"], seed=36, steps=40)


# -- soak ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_alone_several_times_ft(
    world: World, procs: Procs, tmp_path: Path, fault: str, seed: int
) -> None:
    ft_run(world, procs, tmp_path, [fault] * 2, seed=seed, steps=150)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("fault", FAULTS)
def test_each_fault_alone_several_times_rl(
    world: World, procs: Procs, tmp_path: Path, fault: str, seed: int
) -> None:
    rl_run(world, procs, tmp_path, [fault] * 2, seed=seed, steps=40)

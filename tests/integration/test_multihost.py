"""The FT data-parallel job across hosts: network namespaces as hosts
(:mod:`netns`), the controller on one, a replica on each of the others, every
address advertised one the others can reach, and partitions made with
nftables while the job runs.

Invariants checked after every scenario (``check``):

- no two replicas commit different states for the same step (each step line
  carries a digest of the replica's parameters: ``train.log_state_hash``);
- a replica's committed steps never go backwards, within an incarnation;
- the job ends with every replica holding the same state, at the last step.

A replica of several ranks may itself span hosts (issue 41): one agent per host
(``phalanx agent --nnodes 2 --node-rank K --master-addr HOST:PORT``), or one
ranks launcher per host (``python -m phalanx.launch.ranks`` with the same
options).

Root only (the namespaces); skipped with the reason otherwise.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ftjob import FTJob, Proc, Replica, assert_identical, audit_job, write_job
from procs import PROGRESS_S, Controller, Procs, wait_for, write_job_toml
from test_agent import stop_agent, worker_lines
from test_rl import RLReplica, check_ledger, job_sections, rl_status, wait_finished

from phalanx.net import free_port
from phalanx.testing import netns

REASON = netns.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

TRAIN = {"steps": 30, "log_state_hash": True, "step_delay_s": 0.02}


@pytest.fixture(scope="module")
def net() -> Iterator[netns.Net]:
    """A switch with hosts c (the controller) and r1..r3 (replicas), shared by the
    module's tests; removed at the end, even after a failure."""
    n = netns.Net()
    try:
        for name in ("c", "r1", "r2", "r3"):
            n.add_host(name)
        n.watch_from_here()
        yield n
    finally:
        n.close()


@pytest.fixture
def job(tmp_path: Path, net: netns.Net) -> Iterator[FTJob]:
    j = FTJob(
        tmp_path, write_job(tmp_path / "job.toml", train=TRAIN, policy={"n_init_replicas": 2})
    )
    try:
        yield j
    finally:
        j.cleanup()
        for h in net.hosts.values():
            net.heal(h)


def steps_of(replicas: list[Replica]) -> dict[int, dict[str, str]]:
    """step -> {replica id: state digest}, from every replica's step lines."""
    out: dict[int, dict[str, str]] = {}
    for r in replicas:
        for e in r.events:
            if e["event"] == "step":
                out.setdefault(e["step"], {})[e["replica"]] = e["state_hash"]
    return out


def check(replicas: list[Replica], finals: list[dict[str, Any]], steps: int) -> None:
    for step, by in sorted(steps_of(replicas).items()):
        assert len(set(by.values())) == 1, f"step {step}: replicas committed different states {by}"
    for r in replicas:
        seen: dict[str, int] = {}
        for e in (e for e in r.events if e["event"] == "step"):
            assert e["step"] > seen.get(e["replica"], 0), f"{r.label}: step went back at {e}"
            seen[e["replica"]] = e["step"]
    assert_identical(finals)
    assert all(int(f["__meta__"]["step"]) == steps for f in finals)


def test_the_ft_job_runs_across_hosts(job: FTJob, net: netns.Net) -> None:
    c, r1, r2 = net.hosts["c"], net.hosts["r1"], net.hosts["r2"]
    job.start_controller(host=c)
    url = (job.state_dir / "url").read_text().strip()
    assert url == f"http://{c.ip}:{url.rsplit(':', 1)[1]}", url
    a, b = job.start_replica("a", host=r1), job.start_replica("b", host=r2)
    a.wait_step(3)
    members = job.status()["roles"]["policy"]["replicas"]
    assert sorted(m["address"].rsplit(":", 1)[0] for m in members) == sorted([r1.ip, r2.ip])
    finals = [a.finish(), b.finish()]
    check([a, b], finals, TRAIN["steps"])
    assert any(e["participants"] == 2 for e in a.events if e["event"] == "step")


def wait_all(replicas: list[Replica], pred: Any, what: str) -> None:
    for r in replicas:
        r.wait_event(lambda e: e["event"] == "step" and pred(e), f"{r.label}: {what}")


PARTITIONS = {
    # kind: (who is cut, from whom) as host names
    "replica_from_controller": ("r3", ["c"]),
    "replica_from_peers": ("r3", ["r1", "r2"]),
    "minority_from_all": ("r3", ["c", "r1", "r2"]),
    "controller_from_all": ("c", ["r1", "r2", "r3"]),
}
HOLD_S = 5.0
"""How long a partition lasts: past the heartbeat timeout (2 s), so that every
detector has fired before it heals."""


def three_replicas(job: FTJob, net: netns.Net) -> list[Replica]:
    hosts = net.hosts
    job.start_controller(host=hosts["c"])
    reps = [job.start_replica(n, host=hosts[n]) for n in ("r1", "r2", "r3")]
    wait_all(reps, lambda e: e["participants"] == 3 and e["step"] >= 5, "3 together")
    return reps


def long_job(tmp_path: Path) -> FTJob:
    """A job that runs until the test stops it (its steps outlast every scenario)."""
    train = {**TRAIN, "steps": 100_000, "step_delay_s": 0.03}
    return FTJob(
        tmp_path, write_job(tmp_path / "job.toml", train=train, policy={"n_init_replicas": 3})
    )


def test_partitions_one_after_another_lose_no_agreement(tmp_path: Path, net: netns.Net) -> None:
    """During one FT job, each kind of partition in turn, each for HOLD_S (past the
    heartbeat timeout), then healed: a replica cut from the controller, from its
    peers, from everyone; the controller cut from everyone; 20% packet loss between
    the replicas. After each cut of a replica, the survivors commit without it;
    after each heal, the three commit together again. Every step is agreed."""
    job = long_job(tmp_path)
    h = net.hosts
    try:
        reps = three_replicas(job, net)
        for kind in [*PARTITIONS, "loss"]:
            cut_at = time.monotonic()
            if kind == "loss":
                for a, b in (("r1", "r2"), ("r1", "r3"), ("r2", "r3")):
                    net.loss(h[a], [h[b]], 20)  # each pair once: 20% each way
            else:
                who, others = PARTITIONS[kind]
                net.cut(h[who], [h[o] for o in others])
                if who != "c":
                    reps[0].wait_event(
                        lambda e, t=cut_at: (
                            e["event"] == "step" and e["_at"] > t and e["participants"] == 2
                        ),
                        f"{kind}: the survivors to commit without r3",
                    )
            time.sleep(HOLD_S)  # (the partition's length, not a wait for an event)
            for x in h.values():
                net.heal(x)
            healed_at = time.monotonic()
            wait_all(
                reps,
                lambda e, t=healed_at: e["_at"] > t and e["participants"] == 3,
                f"{kind}: the three to commit together again",
            )
    finally:
        job.cleanup()
        for x in h.values():
            net.heal(x)
    # The product audit: every step agreed (one loss, cursor and state digest), none
    # committed twice or going back, none missing, the sampler's batches.
    audit_job(job, None)


def test_the_rl_job_runs_across_hosts_through_partitions(
    tmp_path: Path, procs: Procs, net: netns.Net
) -> None:
    """The RL job with its controller on c, its policy on r1 and rollout replicas on
    r2 and r3 (weights synced across hosts). A rollout replica is cut from every
    other host for HOLD_S (its leases expire and go to r2), then the policy is cut
    from the controller for HOLD_S (it is evicted, and comes back as a new
    incarnation). The job finishes, no prompt is trained twice and the ledger
    balances."""
    c, r1, r2, r3 = (net.hosts[n] for n in ("c", "r1", "r2", "r3"))
    sections = job_sections(rollout_init=2, steps=40, target_reward=0.99)
    # Paced (0.1 s per prompt: 0.4 s a lease) so that the job outlasts both cuts
    # however fast the machine trains.
    sections["rl.loop"]["gen_delay_s"] = 0.1
    config = write_job_toml(tmp_path / "rl.toml", sections)
    ctl = Controller(procs, tmp_path / "state", config, host=c).start()
    policy = RLReplica(procs, ctl, config, "policy", "policy-0", host=r1)
    ra = RLReplica(procs, ctl, config, "rollout", "rollout-a", host=r2)
    rb = RLReplica(procs, ctl, config, "rollout", "rollout-b", host=r3)
    try:
        wait_for(lambda: rl_status(ctl)["policy_step"] >= 4, PROGRESS_S, "policy step 4")
        wait_for(
            lambda: any(e["ok"] and e["version"] > 0 for e in rb.events("sync")),
            PROGRESS_S,
            "weights synced to r3 across hosts",
        )
        for who, others in ((r3, [c, r1, r2]), (r1, [c])):
            net.cut(who, others)
            time.sleep(HOLD_S)  # (the partition's length)
            net.heal(who)
            at = rl_status(ctl)["policy_step"]
            wait_for(
                lambda a=at: (s := rl_status(ctl))["policy_step"] > a or s["finished"],
                PROGRESS_S,
                "progress after the heal",
            )
        st = wait_finished(ctl, [policy, ra, rb], timeout=PROGRESS_S)
    finally:
        for h in net.hosts.values():
            net.heal(h)
    check_ledger(ctl, st, [policy])
    kinds = [e["kind"] for e in ctl.status()["events"]]
    assert "evict" in kinds, "the cut replicas were never evicted"


def test_an_advertised_address_peers_cannot_reach_is_one_line(
    tmp_path: Path, net: netns.Net
) -> None:
    """A replica that advertises another host's address cannot reach its own store
    there; one the controller cannot connect to is refused at registration. Each
    says so in one line naming the address, exits 78 (no restart helps), and the
    job goes on without it."""
    c, r1, r2 = (net.hosts[n] for n in ("c", "r1", "r2"))
    job = FTJob(tmp_path, write_job(tmp_path / "job.toml", train={**TRAIN, "steps": 100_000}))
    try:
        job.start_controller(host=c)
        a = job.start_replica("a", host=r1)
        a.wait_step(2)
        wrong = dataclasses.replace(r2, ip=r1.ip)  # on r2, advertising r1's address
        b = job.start_replica("b", host=wrong)
        assert b.popen.wait(timeout=PROGRESS_S) == 78
        err = b.err_path.read_text()
        assert f"the advertised address '{r1.ip}' must be an address of this host" in err
        net.block_new(c, [r2])  # the controller cannot connect to r2
        d = job.start_replica("d", host=r2)
        assert d.popen.wait(timeout=PROGRESS_S) == 78
        err = d.err_path.read_text()
        assert "controller refused this replica" in err and f"{r2.ip}:" in err, err
        for e in (b.err_path.read_text(), err):
            assert "Traceback" not in e and len(e.strip().splitlines()) <= 3, e
        at = a.events[-1]["step"]
        a.wait_event(lambda e: e["event"] == "step" and e["step"] > at + 2, "a going on")
    finally:
        job.cleanup()
        for h in net.hosts.values():
            net.heal(h)


# -- a replica across hosts ------------------------------------------------------


def replica_cmd(job: FTJob, name: str) -> list[str]:
    return [sys.executable, "-m", "phalanx.cli", "replica", "--config", str(job.config),
            "--controller", str(job.state_dir), "--name", name]  # fmt: skip


def spread_agent(job: FTJob, name: str, host: netns.Host, node: int, master: str) -> Proc:
    """``phalanx agent`` of node ``node`` of replica ``name`` (one worker per node)."""
    run_dir = job.workdir / f"agent-{name}-{node}"
    args = [sys.executable, "-m", "phalanx.cli", "agent", "--config", str(job.config)]
    args += ["--controller", str(job.state_dir), "--name", name, "--run-dir", str(run_dir)]
    args += ["--nproc", "1", "--nnodes", "2", "--node-rank", str(node), "--master-addr", master]
    args += ["--backoff-s", "0.2", "--node", host.name]
    p = Proc(args, f"agent-{name}-{node}", job.workdir, host=host)
    p.run_dir = run_dir  # type: ignore[attr-defined]
    return p


def spread_ranks(job: FTJob, name: str, host: netns.Host, node: int, master: str) -> Proc:
    """``phalanx.launch.ranks`` of node ``node`` of replica ``name`` (one rank per node)."""
    args = [sys.executable, "-m", "phalanx.launch.ranks", "--nproc", "1", "--nnodes", "2"]
    args += ["--node-rank", str(node), "--master-addr", master, "--", *replica_cmd(job, name)]
    p = Proc(args, f"ranks-{name}-{node}", job.workdir, host=host)
    job.procs.append(p)
    return p


def node0_steps(agent: Proc, gen: int) -> list[dict[str, Any]]:
    """The step lines of generation ``gen`` of the agent's rank 0 (it leads node 0)."""
    run_dir: Path = agent.run_dir  # type: ignore[attr-defined]
    return [e for e in worker_lines(run_dir, gen) if e.get("event") == "step"]


def test_a_replica_spans_two_hosts_trains_with_the_others_and_fails_together(
    tmp_path: Path, net: netns.Net
) -> None:
    """FT-HSDP, replicas of 2 ranks. Replica a: rank 0 on r1, rank 1 on r2, one agent
    per host; replica b: rank 0 on r3, rank 1 on r1, one ranks launcher per host.
    Both train together across the hosts. Then a's rank 1 is SIGKILLed on r2: both
    of a's agents stop their workers and start the next generation together (the
    leader on r1 restarts it, the follower on r2 follows), and a comes back as a new
    incarnation, heals from b and trains with it again. Every step both committed
    has one loss."""
    c, r1, r2, r3 = (net.hosts[n] for n in ("c", "r1", "r2", "r3"))
    train = {**TRAIN, "steps": 100_000, "step_delay_s": 0.03}
    job = FTJob(
        tmp_path,
        write_job(tmp_path / "job.toml", train=train, policy={"n_init_replicas": 2}, ranks=2),
    )
    agents: list[Proc] = []
    try:
        job.start_controller(host=c)
        a_master, b_master = f"{r1.ip}:{free_port()}", f"{r3.ip}:{free_port()}"
        agents += [spread_agent(job, "a", r2, 1, a_master), spread_agent(job, "a", r1, 0, a_master)]
        follower, leader = agents
        spread_ranks(job, "b", r1, 1, b_master)
        b = spread_ranks(job, "b", r3, 0, b_master)
        start = follower.wait_event(lambda e: e["event"] == "start", "a's rank 1 on r2")
        b.wait_event(lambda e: e["event"] == "step" and e["participants"] == 2, "a and b together")
        assert start["node_rank"] == 1 and start["workers"][0]["rank"] == 1
        os.kill(start["workers"][0]["pid"], signal.SIGKILL)
        for ag in agents:
            ag.wait_event(lambda e: e["event"] == "start" and e["generation"] == 1, "generation 1")
        assert any(e["event"] == "node_exit" and e["node"] == 1 for e in leader.events)
        assert any(e["event"] == "stopped" and e["generation"] == 0 for e in leader.events)
        again = wait_for(
            lambda: [e for e in node0_steps(leader, 1) if e["participants"] == 2],
            PROGRESS_S,
            "a's generation 1 to train with b again",
        )
        assert again[0]["replica"] != node0_steps(leader, 0)[0]["replica"]  # a new incarnation
        assert any(e["healed"] for e in node0_steps(leader, 1)), "a did not heal from b"
        b_loss = {e["step"]: e["loss"] for e in b.steps()}
        both = [e for g in (0, 1) for e in node0_steps(leader, g) if e["step"] in b_loss]
        assert both and all(e["loss"] == b_loss[e["step"]] for e in both), both
    finally:
        for ag in agents:
            stop_agent(ag, ag.run_dir)  # type: ignore[attr-defined]
        job.cleanup()

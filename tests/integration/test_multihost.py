"""The FT data-parallel job across hosts: network namespaces as hosts
(:mod:`netns`), the controller on one, a replica on each of the others, every
address advertised one the others can reach, and partitions made with
nftables while the job runs.

Invariants checked after every scenario (``check``):

- no two replicas commit different states for the same step (each step line
  carries a digest of the replica's parameters: ``train.log_state_hash``);
- a replica's committed steps never go backwards, within an incarnation;
- the job ends with every replica holding the same state, at the last step.

Root only (the namespaces); skipped with the reason otherwise.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import netns
import pytest
from ftjob import FTJob, Replica, assert_identical, write_job

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
    j = FTJob(tmp_path, write_job(tmp_path / "job.toml", train=TRAIN, policy={"n_init_replicas": 2}))
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

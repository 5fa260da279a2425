"""``sbatch deploy/slurm/phalanx.sbatch`` on a real Slurm cluster (slurmctld and four
slurmd "nodes" on this host: :mod:`phalanx.testing.slurm`, one cluster for the
module): an FT job that loses a node mid-job (its slurmd and job steps SIGKILLed;
Slurm marks it DOWN, the job goes on, the lost replica's agent is started again on a
node the job still has, and the node comes back to service); the RL job as a hetjob
(two policy nodes, the first with the controller, in component 0; two rollout
nodes in component 1) that loses
a rollout node the same way; and a job that asks for more replicas than its nodes
hold, refused in one line before anything starts. ``phalanx audit`` checks each job
dir: every step committed once, the ledger balanced, no prompt trained twice."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from slurm_cluster import slurm  # noqa: F401  (a module-scoped fixture)
from tests.integration.ftjob import child_env

from phalanx.testing.slurm import NODES, SlurmCluster, steps_seen, wait_until

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
RL_PROMPTS = 16  # sort_grpo.toml's prompts_per_step


def submit(
    cluster: SlurmCluster, tmp: Path, config: Path, *overrides: str, groups: tuple[int, ...]
) -> tuple[str, Path]:
    """Submit the job (``groups``: each component's nodes); returns (job id, job dir)."""
    env = {**child_env(), "OMP_NUM_THREADS": "1"}
    return cluster.submit(tmp, config, *overrides, groups=groups, env=env)


def audit(job_dir: Path) -> dict:
    p = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "audit", str(job_dir), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    return json.loads(p.stdout)


def output(tmp: Path, job: str) -> str:
    return (tmp / f"slurm-{job}.out").read_text(errors="replace")


def lose_and_bring_back(cluster: SlurmCluster, node: str, job_dir: Path, agent: str) -> None:
    """Lose ``node`` (a power cut), wait until Slurm marks it DOWN and ``agent`` is
    started again elsewhere (``agent-NAME.1``), then bring the node back to service."""
    assert cluster.lose_node(node)
    cluster.wait_state(node, "down*", "down", timeout=120)  # Slurm's own detection
    wait_until(lambda: (job_dir / f"agent-{agent}.1").is_dir(), 60, f"{agent}'s agent again")
    cluster.start_node(node)
    cluster.wait_state(node, "idle", timeout=120)  # ReturnToService=2: back in service


def test_an_ft_job_goes_on_when_a_node_is_lost_and_the_audit_passes(
    slurm: SlurmCluster,  # noqa: F811  (the fixture)
    tmp_path: Path,
):
    steps = 400
    job, job_dir = submit(
        slurm,
        tmp_path,
        EXAMPLES / "ft_mlp.toml",
        f"--train.steps={steps}",
        "--train.step_delay_s=0.05",
        groups=(2,),
    )
    wait_until(lambda: steps_seen(job_dir), 120, "the job's first committed step", every=0.5)
    # The first node holds the batch script and the controller; the second holds
    # policy-1 alone.
    first, second = NODES[:2]
    lose_and_bring_back(slurm, second, job_dir, "policy-1")
    at_back = max(steps_seen(job_dir))
    state = slurm.wait_job(job, 600)
    said = output(tmp_path, job)
    assert state == "COMPLETED", said[-3000:]
    assert f"node {second} left the job" in said, said[-3000:]
    assert f"starting the agent again on {first}" in said, said[-3000:]
    assert max(steps_seen(job_dir)) == steps and at_back < steps
    report = audit(job_dir)
    assert report["ok"], report


def test_an_rl_job_goes_on_when_a_rollout_node_is_lost_and_the_audit_passes(
    slurm: SlurmCluster,  # noqa: F811  (the fixture)
    tmp_path: Path,
):
    """Component 0: n1 (policy-0, the controller) and n2 (policy-1); component 1: n3
    (rollout-0) and n4 (rollout-1). n4 is lost (a component of one node would be
    requeued with the whole job: see ``NODES``). With ``roles.rollout.min_replicas =
    2`` no prompt is leased while rollout-1 is away, so the job can only end once its
    agent runs again on a node the job still has."""
    batches = 20  # each >= 16 prompts x 0.1 s over 2 replicas: the loss lands mid-job
    job, job_dir = submit(
        slurm,
        tmp_path,
        EXAMPLES / "sort_grpo.toml",
        f"--rl.grpo.steps={batches}",
        "--rl.loop.target_exact_match=null",
        "--rl.loop.gen_delay_s=0.1",
        "--roles.rollout.min_replicas=2",
        groups=(2, 2),
    )
    # squeue -j names both components (JOB+0, JOB+1), each with its nodes: the
    # script's job_nodes() reads every line.
    rows = wait_until(
        lambda: (
            [
                r.split()
                for r in slurm.run("squeue", "-h", "-j", job, "-o", "%i %N").splitlines()
                if len(r.split()) == 2
            ]
            or None
        ),
        60,
        "both components to start",
    )
    assert sorted(rows) == [[f"{job}+0", "n[1-2]"], [f"{job}+1", "n[3-4]"]], rows
    wait_until(lambda: steps_seen(job_dir), 120, "the job's first committed step", every=0.5)
    lost = NODES[3]
    lose_and_bring_back(slurm, lost, job_dir, "rollout-1")
    state = slurm.wait_job(job, 600)
    said = output(tmp_path, job)
    assert state == "COMPLETED", said[-3000:]
    assert f"node {lost} left the job" in said, said[-3000:]
    assert max(steps_seen(job_dir)) == 2 * batches  # inner_epochs = 2 commits a batch
    again = (job_dir / "agent-rollout-1.1" / "gen0" / "rank0.out").read_text()
    assert '"event": "rollout"' in again  # the replica started again generated
    report = audit(job_dir)
    assert report["ok"], report
    (trained,) = [c["detail"] for c in report["checks"] if c["check"] == "ledger.trained_once"]
    n = batches * RL_PROMPTS
    assert trained.startswith(f"{n} rollouts of {n} prompts in {batches} batches"), trained


def test_more_replicas_than_the_nodes_hold_is_one_line_before_anything_starts(
    slurm: SlurmCluster,  # noqa: F811  (the fixture)
    tmp_path: Path,
):
    """No GPUs here: one policy replica per node bounds a role's min_replicas, given in
    the file or as an override."""
    job, job_dir = submit(
        slurm, tmp_path, EXAMPLES / "ft_mlp.toml", "--roles.policy.min_replicas=3", groups=(2,)
    )
    assert slurm.wait_job(job, 120) == "FAILED"
    said = output(tmp_path, job)
    assert said == (
        "phalanx.sbatch: the allocation gives policy 2 replica(s): roles.policy.min_replicas "
        "in the job config must be <= 2, got 3. Ask for more nodes, or lower it.\n"
    ), said
    assert not job_dir.exists()

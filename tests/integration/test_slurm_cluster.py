"""``sbatch deploy/slurm/phalanx.sbatch`` on a real Slurm cluster (slurmctld and two
slurmd "nodes" on this host: :mod:`slurm_cluster`): an FT job with a node lost
mid-job (its slurmd and job steps SIGKILLed; Slurm marks it DOWN, the job goes on,
the lost replica's agent is started again on the other node, and the node comes
back to service), checked by the product's ``phalanx audit``; an RL job; and a job
that asks for more replicas than the allocation holds, refused in one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from slurm_cluster import NODES, SlurmCluster, slurm, wait_until  # noqa: F401  (slurm: a module-scoped fixture)
from tests.integration.ftjob import child_env

from phalanx.net import free_port

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "slurm" / "phalanx.sbatch"
EXAMPLES = ROOT / "examples"


def edited_script(tmp: Path, *, het: bool) -> Path:
    """The script with its resources edited to this 2-node cluster, as its header tells
    a user to: one node per component for an RL job, and for a job without rollout
    replicas the hetjob lines deleted (two nodes of policy replicas)."""
    text = SCRIPT.read_text()
    start, end = text.index("## group 0"), text.index("\nset -uo pipefail")
    group = (
        "#SBATCH --nodes={}\n#SBATCH --ntasks-per-node=1\n#SBATCH --exclusive\n#SBATCH --no-kill\n"
    )
    sbatch = group.format(1) + "#SBATCH hetjob\n" + group.format(1) if het else group.format(2)
    out = tmp / "phalanx.sbatch"
    out.write_text(text[:start] + sbatch + text[end:])
    return out


def submit(
    cluster: SlurmCluster, tmp: Path, config: Path, *overrides: str, het: bool
) -> tuple[str, Path]:
    """Submit the job; returns (job id, its job dir)."""
    job_dir = tmp / "job"
    env = child_env()
    env.update(
        PHALANX_BIN=str(Path(sys.executable).parent / "phalanx"),
        PHALANX_PYTHON=sys.executable,
        PHALANX_JOB_DIR=str(job_dir),
        PHALANX_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
    )
    script = edited_script(tmp, het=het)
    job = cluster.sbatch(
        f"--output={tmp}/slurm-%j.out", str(script), str(config), *overrides, env=env, cwd=tmp
    )
    return job, job_dir


def steps_seen(job_dir: Path) -> list[int]:
    """The steps the job's replicas have printed as committed so far."""
    out = []
    for f in job_dir.glob("agent-*/gen*/rank0.out"):
        for line in f.read_text(errors="replace").splitlines():
            if line.startswith("{") and '"event": "step"' in line:
                try:
                    out.append(int(json.loads(line)["step"]))
                except (ValueError, KeyError):
                    continue
    return out


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
        het=False,
    )
    wait_until(lambda: steps_seen(job_dir), 120, "the job's first committed step", every=0.5)
    # The first node holds the batch script and the controller; the second holds
    # policy-1 alone.
    first, second = NODES
    killed = slurm.lose_node(second)
    assert killed
    slurm.wait_state(second, "down*", "down", timeout=120)  # Slurm's own detection
    at_loss = max(steps_seen(job_dir))
    # policy-1's agent is started again on the first node, beside policy-0.
    wait_until(lambda: (job_dir / "agent-policy-1.1").is_dir(), 60, "policy-1's agent again")
    slurm.start_node(second)
    slurm.wait_state(second, "idle", timeout=120)  # ReturnToService=2: back in service
    state = slurm.wait_job(job, 600)
    said = output(tmp_path, job)
    assert state == "COMPLETED", said[-3000:]
    assert f"node {second} left the job" in said, said[-3000:]
    assert f"starting the agent again on {first}" in said, said[-3000:]
    assert max(steps_seen(job_dir)) == steps and at_loss < steps
    report = audit(job_dir)
    assert report["ok"], report

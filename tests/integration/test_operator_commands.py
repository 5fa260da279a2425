"""The dashboard's actions reach real FT replicas through the command queue:
"checkpoint now" makes the quorum save the named step, and "drain" makes a
replica leave after a commit while the others finish the job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from ftjob import FTJob, write_job


def post(job: FTJob, path: str, body: dict[str, Any]) -> dict[str, Any]:
    url = (job.state_dir / "url").read_text().strip()
    token = (job.state_dir / "token").read_text().strip()
    r = httpx.post(f"{url}{path}", json=body, headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200, r.text
    return r.json()


def test_checkpoint_now_and_drain_reach_the_replicas(tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    cfg = write_job(
        tmp_path / "job.toml",
        train={"steps": 60, "step_delay_s": 0.03},
        policy={"n_init_replicas": 2},
    )
    with cfg.open("a") as f:
        f.write(f'\n[checkpoint]\nurl = "{ckpt}"\n')
    job = FTJob(tmp_path, cfg)
    try:
        job.start_controller()
        a, b = job.start_replica("a"), job.start_replica("b")
        a.wait_step(5)
        post(job, "/v1/checkpoints/trigger", {"lead_steps": 5})
        ev = a.wait_event(lambda e: e["event"] == "checkpoint", "the ordered checkpoint")
        assert ev["step"] < 60
        b_id = b.wait_step(1)["replica"]
        post(job, "/v1/replicas/drain", {"replica_id": b_id})
        done = b.wait_event(lambda e: e["event"] == "done", "b drained")
        assert done["drained"] is True and done["step"] < 60, done
        a.finish()
        after = [e for e in a.steps() if e["step"] > done["step"] + 1]
        assert after and all(e["participants"] == 1 for e in after)
        assert b.popen.wait(30) == 0
    finally:
        job.cleanup(exit_grace_s=15.0)

"""The RL main job (``phalanx run``, real policy and rollout replicas) with its
rollout payloads kept in Redis or in storage instead of the controller, and
its weights moved through them instead of the collective: only
``[rl.transport]`` changes, and the controller's rollout ledger still
balances, every prompt trained once, every payload dropped once trained."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from procs import child_env
from redis_server import redis_url  # noqa: F401  (a pytest fixture)
from test_rl_launch import PROMPTS, rl_job, summary_of

from phalanx.transport.redis_conn import connect
from phalanx.transport.redis_store import RedisRolloutStore
from phalanx.transport.redis_weights import RedisWeightStore
from phalanx.transport.storage_store import StorageRolloutStore
from phalanx.transport.storage_weights import StorageWeightStore


@pytest.mark.parametrize("kind", ["redis", "file"])
def test_rl_job_runs_on_each_transport(kind: str, tmp_path: Path, request: pytest.FixtureRequest):
    if kind == "redis":
        url = request.getfixturevalue("redis_url")
        rollouts, weights = url, url
    else:
        rollouts, weights = f"file://{tmp_path}/rollouts", f"file://{tmp_path}/weights"
    timeouts = {"collective_s": 10.0, "heartbeat_s": 20.0, "quorum_s": 60.0}
    config = rl_job(tmp_path / "job.toml", steps=30, timeouts=timeouts)
    job_id = f"rl-{kind}-{tmp_path.name}"[:60]
    args = [sys.executable, "-m", "phalanx.cli", "run", str(config), "--plain", "--json"]
    args += ["--run-dir", str(tmp_path / "run"), "--rl.grpo.steps", "5"]
    args += ["--rl.loop.target_exact_match", "1.0", "--job.id", job_id]
    args += ["--rl.transport.rollouts", rollouts, "--rl.transport.weights", weights]
    p = subprocess.Popen(
        args,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
        start_new_session=True,
    )
    try:
        out, err = p.communicate(timeout=150)
    finally:
        if p.poll() is None:
            p.terminate()  # the launcher stops its replicas and controller on SIGTERM
            p.communicate(timeout=30)
    assert p.returncode == 0, f"{err[-3000:]}\n{out[-3000:]}"
    s = summary_of(out)
    assert s["ok"] and s["batches"] == 5 and s["ledger_ok"], s
    assert s["trained"] == 5 * PROMPTS
    assert s["syncs"] >= 1, "no weight sync went through the store"
    # What went through the store: nothing lost (dropped as trained or with a reason,
    # or still held when the job ended) and nothing corrupt.
    if kind == "redis":
        assert RedisWeightStore(weights, job_id).latest() is not None
        r = connect(rollouts)
        # The store lives under the job id and the ledger's run (a rerun starts afresh).
        (key,) = r.keys(f"phalanx:{job_id}.*:payloads:counts")
        c = RedisRolloutStore(rollouts, key.decode().split(":")[1]).counts()
    else:
        assert StorageWeightStore(weights).latest() is not None
        (run,) = [p.name for p in (tmp_path / "rollouts").iterdir()]
        assert run.startswith(f"{job_id}.")
        c = StorageRolloutStore(rollouts, run).counts()
    assert c["put"] == c["trained"] + sum(c["discarded"].values()) + c["held"] + c["corrupt"]
    assert c["trained"] >= 5 * PROMPTS and c["corrupt"] == 0

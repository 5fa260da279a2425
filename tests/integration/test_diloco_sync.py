"""Synchronous DiLoCo jobs: real controller and ``phalanx replica`` processes
(gloo), real SIGKILL.

- 3 replicas; one is SIGKILLed mid-job and comes back (a warm spare): every
  round 1..N commits once, its data exactly once (the replicas' shares of a
  round are disjoint and make up the round's H * B samples), the rejoined
  replica heals (model, inner optimizer and outer state) and every replica
  ends bit-identical;
- the outer state is part of checkpoints: a job killed whole and resumed from
  its checkpoint ends bit-identical to one that never stopped.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

from ftjob import (
    TRAIN,
    FTJob,
    Replica,
    assert_identical,
    assert_same_files,
    audit_job,
    step_lines,
    write_job,
)
from procs import wait_for

from phalanx.checkpoint import CheckpointStore

H, ROUNDS = 4, 12
BATCH = TRAIN["global_batch_size"]
SEED = 7
DILOCO = {"mode": "sync", "sync_every": H, "outer_lr": 0.7, "outer_momentum": 0.9}


def _job(
    root: Path,
    name: str,
    jobs: list[FTJob],
    n: int,
    timeouts: dict[str, float] | None = None,
    **train: Any,
) -> FTJob:
    """A sync DiLoCo job of ``n`` replicas (its controller started)."""
    d = root / name
    d.mkdir()
    cfg = write_job(
        d / "job.toml",
        job_id=name,
        train={"steps": H * ROUNDS, **train},
        policy={"n_init_replicas": n},
        timeouts=timeouts,
    )
    with cfg.open("a") as f:
        f.write("\n[diloco]\n")
        for k, v in DILOCO.items():
            f.write(f"{k} = {v!r}\n".replace("'", '"'))
    job = FTJob(d, cfg)
    jobs.append(job)
    job.start_controller()
    return job


def _cleanup(jobs: list[FTJob]) -> None:
    errors = []
    for job in jobs:
        try:
            job.cleanup(exit_grace_s=15.0)
        except AssertionError as e:
            errors.append(str(e))
    assert not errors, "\n".join(errors)


def test_sync_diloco_survives_a_kill_and_the_replica_rejoins(tmp_path: Path):
    jobs: list[FTJob] = []
    try:
        # step_delay_s paces the rounds (about 0.4 s each) so that the restart
        # (a warm spare) joins well before the job ends.
        # A SIGKILLed peer is found by the survivors' failed all-reduce and cannot
        # answer the probe: these timeouts do not slow its eviction, and keep a live
        # replica on a loaded machine from being taken for dead.
        timeouts = {"heartbeat_s": 10.0, "suspect_grace_s": 1.0}
        job = _job(tmp_path, "kill", jobs, 3, timeouts, step_delay_s=0.05)
        a, b, c = (job.start_replica(n) for n in "abc")
        restart = job.start_replica("c", spare=True)
        c.wait_step(3)
        c.kill()
        a.wait_step(5)
        restart.release()
        finals = [r.finish(timeout=120) for r in (a, b, restart)]
        # The product audit: each round committed once, its cursor at H * B a round,
        # and its shares together the sampler's H * B samples for the round.
        audit_job(job, ROUNDS, dataset_size=TRAIN["dataset_size"])
        lines = step_lines([a, b, c, restart])
        # Parameters are θ_global on every replica after a round; the inner AdamW
        # states differ (each replica saw its own data) and are not in the final
        # file, which is the same bytes on every replica.
        assert_identical(finals)
        assert all(k.startswith("model.") for k in finals[0] if k != "__meta__")
        assert_same_files([a, b, c, restart], ROUNDS)
        # The survivors went on with 2 while c was down; c's new incarnation
        # healed at the start of a round and took part in every round after.
        assert any(e["participants"] == 2 for by in lines.values() for e in by.values())
        first = restart.steps()[0]
        assert first["healed"] is True and first["participants"] == 3, first
        for rnd in range(first["step"], ROUNDS + 1):
            assert {e["participants"] for e in lines[rnd].values()} == {3}, rnd
        # Communication: one all-reduce of the parameters per round, none per inner step.
        nparams = sum(v.numel() for k, v in finals[0].items() if k.startswith("model."))
        last = a.steps()[-1]
        assert last["bytes_sent"] == ROUNDS * nparams * 8, last
        # A replica writes its final state before it leaves (and reports its last
        # commit as it deregisters): the controller's step follows within moments.
        wait_for(
            lambda: job.status()["roles"]["policy"]["step"] == ROUNDS,
            10,
            "the controller's step to reach the last round",
        )
    finally:
        _cleanup(jobs)


def test_outer_state_is_checkpointed(tmp_path: Path):
    """Killed whole after a checkpoint at round 4, resumed: bit-identical to a
    run that never stopped, so θ_global and the outer Nesterov momentum were
    restored. (Inner SGD without momentum: a checkpoint, like a heal, carries
    one replica's inner optimizer state, so with AdamW the resumed replicas
    would all start from the saver's.)"""
    ckpt = f"file://{tmp_path / 'ckpt'}"
    opts = ("--checkpoint.url", ckpt, "--checkpoint.every_steps", "2")
    jobs: list[FTJob] = []
    try:
        sgd = {"optimizer": "sgd", "lr": 0.05}
        ref = _job(tmp_path, "ref", jobs, 2, **sgd)
        refs = [ref.start_replica(n) for n in "ab"]
        first = _job(tmp_path, "first", jobs, 2, step_delay_s=0.02, **sgd)
        killed = [first.start_replica(n, *opts) for n in "ab"]
        ck = killed[0].wait_event(
            lambda e: e["event"] == "checkpoint" and e["step"] >= 4, "a checkpoint"
        )
        for p in [*killed, first.controller]:
            assert p is not None
            p.signal(signal.SIGKILL)
        for p in killed:
            p.popen.wait(10)
        latest = CheckpointStore(ckpt).latest()
        assert latest is not None and latest >= ck["step"]
        second = _job(tmp_path, "second", jobs, 2, **sgd)
        resumed: list[Replica] = [second.start_replica(n, *opts) for n in "ab"]
        finals = [r.finish(timeout=120) for r in resumed]
        starts = [r.wait_event(lambda e: e["event"] == "start", "start") for r in resumed]
        assert {s["resumed_from"] for s in starts} == {latest}
        assert_identical([*finals, *(r.finish(timeout=120) for r in refs)])
    finally:
        _cleanup(jobs)

"""Decoupled DiLoCo: slots that share nothing but a storage root.

- transports: the same job over ``memory://``, ``file://`` and ``s3://`` (a
  real local S3-compatible server) ends with bit-identical parameters;
- a slot SIGKILLed mid-round: the next round completes without it; restarted
  under the same name, it catches up from storage (its own state, a peer's
  outer state, the decided rounds) and takes part again; every slot ends
  bit-identical.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from ftjob import SPARE, Replica, load_state
from s3 import s3_server  # noqa: F401  (a pytest fixture)

from phalanx.config import load_config
from phalanx.jobs import ReplicaArgs
from phalanx.jobs.diloco_slot import DecoupledReplica
from phalanx.jobs.diloco_syncer import run as run_syncer

TRAIN = {
    "dtype": "float64",
    "in_dim": 8,
    "hidden": [16],
    "out_dim": 2,
    "dataset_size": 512,
    "global_batch_size": 24,
    "micro_batch_size": 4,
    "lr": 0.01,
    "weight_decay": 0.1,
}


def overrides(url: str, **diloco: Any) -> list[str]:
    out = []
    for k, v in TRAIN.items():
        out += [f"--train.{k}", str(v).replace("'", '"')]
    dc = {"mode": "objectstore", "url": url, "sync_every": 4, "replicas": 3, **diloco}
    for k, v in dc.items():
        out += [f"--diloco.{k}", str(v)]
    return out


def run_in_threads(
    url: str, storage_options: dict[str, Any] | None = None, **diloco: Any
) -> list[torch.Tensor]:
    """Three slots in threads, every round decided with all three."""
    args = overrides(url, min_replicas=3, grace_s=0, keep_rounds=2, **diloco)
    args += ["--train.steps", "24"]
    cfg = load_config(None, args)
    if storage_options:
        assert cfg.diloco is not None
        cfg.diloco.storage_options = storage_options
    slots = [DecoupledReplica(cfg, f"r{i}") for i in range(3)]  # seeded init: one at a time
    errors: list[BaseException] = []

    def run(fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException as e:  # surfaced below
            errors.append(e)

    jobs: list[Callable[[], Any]] = [s.run for s in slots]
    if cfg.diloco is not None and cfg.diloco.aggregator == "syncer":
        jobs.append(lambda: run_syncer(ReplicaArgs(cfg, "syncer")))
    threads = [threading.Thread(target=run, args=(fn,)) for fn in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for s in slots:
        assert s.exchange.left_out == 0 and s.exchange.corrupt == 0
        assert s.diloco.inner_steps == 24
    return [torch.cat([p.detach().reshape(-1) for p in s.model.parameters()]) for s in slots]


def test_transports_are_bit_identical(tmp_path: Path, s3_server):  # noqa: F811
    mem = run_in_threads(f"memory://diloco-{uuid.uuid4().hex[:8]}")
    local = run_in_threads(f"file://{tmp_path / 'x'}")
    url, opts = s3_server.sub("diloco-parity")
    s3 = run_in_threads(url, opts)
    for got in (*mem, *local, *s3):
        assert torch.equal(got, mem[0])


def test_a_syncer_serves_every_round_with_the_same_bits():
    """diloco.aggregator = "syncer": a syncer (no part in training) writes each
    round's average; the slots read that one object, and end bit-identical to
    slots that averaged the k objects themselves."""
    plain = run_in_threads(f"memory://diloco-{uuid.uuid4().hex[:8]}")
    served = run_in_threads(f"memory://diloco-{uuid.uuid4().hex[:8]}", aggregator="syncer")
    for got in served:
        assert torch.equal(got, plain[0])


def test_streaming_slots_end_identical():
    """Streaming DiLoCo (2 fragments, overlap tau = 1, mixing alpha = 0.5) through
    storage: every slot ends with the same parameters."""
    got = run_in_threads(f"memory://diloco-{uuid.uuid4().hex[:8]}", fragments=2, tau=1, alpha=0.5)
    for g in got[1:]:
        assert torch.equal(g, got[0])


def start_slot(workdir: Path, config: list[str], name: str, label: str, spare: bool) -> Replica:
    out = workdir / f"{label}.safetensors"
    cli = ["replica", "--name", name, "--out", str(out), *config]
    head = ["-c", SPARE] if spare else ["-m", "phalanx.cli"]
    return Replica([sys.executable, *head, *cli], label, workdir, name, out, spare)


def rounds_of(p: Replica) -> list[dict[str, Any]]:
    with p._cond:
        return [e for e in p.events if e["event"] == "round"]


def test_a_slot_killed_mid_round_is_left_out_then_catches_up(tmp_path: Path):
    url = f"file://{tmp_path / 'store'}"
    config = overrides(url, min_replicas=2, grace_s=0.5, keep_rounds=3, round_timeout_s=60)
    config += ["--train.steps", "64", "--train.step_delay_s", "0.03"]
    procs: list[Replica] = []
    try:
        slots = [start_slot(tmp_path, config, f"r{i}", f"r{i}", False) for i in range(3)]
        procs += slots
        spare = start_slot(tmp_path, config, "r2", "r2-restart", True)
        procs.append(spare)
        r0, r1, r2 = slots
        r2.wait_for(lambda: len([e for e in r2.events if e["event"] == "round"]) >= 3, "round 3")
        time.sleep(0.1)  # into its next round's inner steps
        r2.kill()
        killed_after = rounds_of(r2)[-1]["round"]
        r0.wait_for(
            lambda: any(
                e["event"] == "round" and e["round"] >= killed_after + 4 for e in r0.events
            ),
            "4 rounds without r2",
        )
        spare.release()
        finals = [load_state_from(p) for p in (r0, r1, spare)]
        # The round after the kill was decided without r2 (the same list everywhere).
        by_round: dict[int, list[str]] = {}
        for p in (r0, r1, r2, spare):
            for e in rounds_of(p):
                assert by_round.setdefault(e["round"], e["members"]) == e["members"], e
        assert "r2" not in by_round[killed_after + 1], by_round
        # The restarted slot caught up from storage, then was averaged in again.
        start = spare.wait_event(lambda e: e["event"] == "start", "start")
        assert start["inner_step"] > 4 * killed_after and start["caught_up"] > 0, start
        assert any(e["included"] for e in rounds_of(spare)), rounds_of(spare)
        assert sorted(by_round) == list(range(1, 17))
        for got in finals[1:]:
            for k, v in finals[0].items():
                if k != "__meta__":
                    assert torch.equal(got[k], v), k
    finally:
        for p in procs:
            if p.popen.poll() is None:
                p.signal(signal.SIGKILL)
            p.popen.wait(10)


def load_state_from(p: Replica) -> dict[str, Any]:
    p.wait_event(lambda e: e["event"] == "done", "the done line", 120)
    return load_state(p.out)


def test_with_a_controller_the_quorum_decides_the_members(tmp_path: Path):
    """Slots attached to a controller: a round's members are its quorum of the
    live slots. A killed slot is evicted (its held connection drops), and the
    next round is decided with the two others at once, not after the storage
    deadline (min_replicas = 3 and round_timeout_s = 60 would wait a minute)."""
    from ftjob import FTJob, write_job

    url = f"file://{tmp_path / 'store'}"
    config = overrides(url, min_replicas=3, grace_s=30, round_timeout_s=60)
    config += ["--train.steps", "48", "--train.step_delay_s", "0.03"]
    job = FTJob(tmp_path, write_job(tmp_path / "job.toml", policy={"n_init_replicas": 3}))
    try:
        job.start_controller()
        slots = []
        for i in range(3):
            label = f"c-r{i}"
            out = tmp_path / f"{label}.safetensors"
            cli = ["replica", "--name", f"r{i}", "--out", str(out)]
            cli += ["--controller", str(job.state_dir), *config]
            r = Replica(
                [sys.executable, "-m", "phalanx.cli", *cli], label, tmp_path, f"r{i}", out, False
            )
            job.procs.append(r)
            slots.append(r)
        r0, _, r2 = slots
        r2.wait_for(lambda: len([e for e in r2.events if e["event"] == "round"]) >= 2, "round 2")
        r2.kill()
        killed_at = time.monotonic()
        after = rounds_of(r2)[-1]["round"] + 1
        ev = r0.wait_event(lambda e: e["event"] == "round" and e["round"] == after, "next round")
        assert ev["members"] == ["r0", "r1"], ev
        assert ev["_at"] - killed_at < 20, ev["_at"] - killed_at
        finals = [load_state_from(p) for p in slots[:2]]
        for k, v in finals[0].items():
            if k != "__meta__":
                assert torch.equal(finals[1][k], v), k
    finally:
        job.cleanup()

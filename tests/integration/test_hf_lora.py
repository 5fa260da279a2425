"""``[train.lora]`` on the FT-DDP training job over a Hugging Face causal LM (test_hf_jobs'
small Qwen2 and corpus), with real ``phalanx replica`` processes: a replica SIGKILLed
mid-job and restarted heals the adapter (and its AdamW moments) from a peer, never
the frozen base, and the replicas end with the same adapter bytes."""

from __future__ import annotations

import signal
from pathlib import Path

import test_hf_jobs
from ftjob import FTJob, assert_same_files, audit_job
from test_hf_jobs import HF, sections, start_job

from phalanx.rl.lora import nbytes
from phalanx.rl.model import load_model

hf, jobs = test_hf_jobs.hf, test_hf_jobs.jobs  # its fixtures
STEPS = 60
"""Paced at 0.1 s a micro-batch (3 a step): the restart rejoins well before the end."""


def test_a_killed_lora_replica_heals_only_the_adapter(hf: HF, tmp_path: Path, jobs: list[FTJob]):
    secs = sections(hf, steps=STEPS, step_delay_s=0.1)
    secs["roles.policy"]["n_init_replicas"] = 2
    secs["train.lora"] = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    job = start_job(tmp_path, jobs, "lora", secs)
    a, b = job.start_replica("a"), job.start_replica("b")
    back = job.start_replica("b", spare=True)
    b.wait_step(3)
    b.signal(signal.SIGKILL)
    b.popen.wait(30)
    a.wait_step(5)
    back.release()
    for r in (a, back):
        r.finish()
    audit_job(job, STEPS)
    first = back.steps()[0]
    assert first["healed"], first
    whole = nbytes(load_model(hf.model).state_dict())
    # 2 layers x (q, v) x (A: 4 x 32, B: 32 x 4) fp32, with AdamW's two moments.
    adapter = 2 * 2 * (4 * 32 + 32 * 4) * 4
    assert 3 * adapter <= first["heal"]["bytes"] < 3 * adapter + (64 << 10) < whole, first
    assert_same_files([a, back], STEPS)

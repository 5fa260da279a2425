"""Your model, your data (issue 41): the training jobs on a Hugging Face causal LM (a
small Qwen2 written by ``examples/make_model.py``) and a JSONL corpus, with real
``phalanx replica`` processes and real SIGKILLs.

- pretraining and SFT, 3 replicas, one SIGKILLed mid-step and restarted: it heals,
  the job finishes, every committed global batch is the calm run's (the sampler's
  stream, from the sample ids each replica logs), and the replicas' final files are
  the same bytes;
- HSDP (2 replicas of 2 ranks), sync DiLoCo and decoupled DiLoCo on the same model;
- a DCP checkpoint saved by 3 replicas of 2 ranks loads into 2 replicas of 1 rank,
  bit-identical to the saved state, and training continues from it;
- ``examples/own_loop.py`` under ``phalanx run --chaos``;
- bad input in one line.
"""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from ftjob import FTJob, assert_same_files, audit_job
from procs import child_env, run_to_end, write_job_toml

from phalanx.config import load_config
from phalanx.data.text import load_text_data

ROOT = Path(__file__).resolve().parents[2]
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "small",
    "birds",
    "sing",
]
SEED = 3
BATCH = 12
SEQ = 32
STEPS = 30


@dataclass
class HF:
    model: Path
    pretrain: Path
    sft: Path
    cache: Path


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> HF:
    """A ~0.1M-parameter Qwen2 and its BPE tokenizer (examples/make_model.py, learnt on
    the corpus), a pretraining corpus and an SFT set."""
    d = tmp_path_factory.mktemp("hf")
    rng = random.Random(0)

    def text(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    pretrain = d / "pretrain.jsonl"
    pretrain.write_text(
        "".join(json.dumps({"text": text(rng.randint(10, 60))}) + "\n" for _ in range(300))
    )
    sft = d / "sft.jsonl"
    sft.write_text(
        "".join(
            json.dumps({"prompt": text(4), "response": text(rng.randint(2, 6))}) + "\n"
            for _ in range(200)
        )
    )
    args = [sys.executable, str(ROOT / "examples" / "make_model.py"), str(d / "model")]
    args += ["--data", str(pretrain), "--vocab", "256", "--hidden", "32", "--layers", "2"]
    args += ["--heads", "2", "--kv-heads", "2", "--intermediate", "64", "--max-len", "128"]
    p = subprocess.run(args, capture_output=True, text=True, env=child_env(), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return HF(d / "model", pretrain, sft, d / "cache")


def sections(hf: HF, kind: str = "pretrain", **train: Any) -> dict[str, dict[str, Any]]:
    data = {"path": str(hf.pretrain if kind == "pretrain" else hf.sft), "kind": kind}
    data |= {"seq_len": SEQ, "cache_dir": str(hf.cache)}
    return {
        "job": {"id": f"hf-{kind}", "seed": SEED},
        "timeouts": {
            "collective_s": 2.0,
            "heartbeat_s": 4.0,
            "heartbeat_interval_s": 0.2,
            "suspect_grace_s": 0.25,
            "quorum_s": 60.0,
        },
        "controller": {"tick_s": 0.02},
        "roles.policy": {"min_replicas": 1, "n_init_replicas": 3, "join_timeout_s": 0.5},
        "train": {
            "steps": 16,
            "global_batch_size": BATCH,
            "micro_batch_size": 2,
            "lr": 3e-3,
            "threads": 1,
            "log_samples": True,
            **train,
        },
        "train.model": {"path": str(hf.model)},
        "train.data": data,
    }


def dataset_size(hf: HF, kind: str) -> int:
    """Samples in the job's training data (the sampler draws from as many)."""
    from phalanx.config.data import DataSection

    path = hf.pretrain if kind == "pretrain" else hf.sft
    d = DataSection(path=str(path), kind=kind, seq_len=SEQ, cache_dir=str(hf.cache))
    return len(load_text_data(d, hf.model, split="train", seed=SEED))


@pytest.fixture
def jobs(tmp_path: Path) -> Iterator[list[FTJob]]:
    made: list[FTJob] = []
    yield made
    errors = []
    for j in made:
        try:
            j.cleanup(15.0)
        except AssertionError as e:
            errors.append(e)
    if errors:
        raise errors[0]


def start_job(tmp_path: Path, jobs: list[FTJob], name: str, secs: dict[str, Any]) -> FTJob:
    d = tmp_path / name
    d.mkdir()
    job = FTJob(d, write_job_toml(d / "job.toml", secs))
    jobs.append(job)
    job.start_controller()
    return job


@pytest.mark.parametrize("kind", ["pretrain", "sft"])
def test_a_replica_killed_mid_step_heals_and_the_job_trains_the_calm_runs_batches(
    hf: HF, tmp_path: Path, jobs: list[FTJob], kind: str
):
    # Paced (0.1 s a micro-batch): the restart, a warm spare, rejoins well before the end.
    job = start_job(tmp_path, jobs, kind, sections(hf, kind, steps=STEPS, step_delay_s=0.1))
    a, b, c = (job.start_replica(n) for n in "abc")
    back = job.start_replica("c", spare=True)
    c.wait_step(4)
    c.signal(signal.SIGKILL)  # mid-step: its micro-batches are paced by step_delay_s
    c.popen.wait(30)
    a.wait_step(6)
    back.release()
    finals = [r.finish() for r in (a, b, back)]
    # The product audit: every step committed once, and every committed global batch
    # the sampler's (the calm run's): the same samples in the same steps, whoever
    # trained them.
    audit_job(job, STEPS, dataset_size=dataset_size(hf, kind))
    first = back.steps()[0]
    assert first["healed"] and first["participants"] == 3, first
    assert_same_files([a, b, back], STEPS)
    assert finals[0]["__meta__"]["step"] == str(STEPS)
    # Every step line reports the job's throughput and this process's peak memory.
    assert all(e["tokens_per_s"] > 0 and e["peak_mem_mb"] > 0 for e in a.steps())


def test_hsdp_and_sync_diloco_train_the_hf_model(hf: HF, tmp_path: Path, jobs: list[FTJob]):
    """HSDP: 2 replicas of 2 ranks (FSDP2 inside each), beside sync DiLoCo (H = 4) with
    2 replicas, both on the Qwen2."""
    hsdp_secs = sections(hf, steps=8) | {"replica": {"ranks": 2}}
    hsdp_secs["roles.policy"]["n_init_replicas"] = 2
    diloco_secs = sections(hf, steps=16) | {"diloco": {"sync_every": 4}}
    diloco_secs["roles.policy"]["n_init_replicas"] = 2
    h = start_job(tmp_path, jobs, "hsdp", hsdp_secs)
    dl = start_job(tmp_path, jobs, "diloco", diloco_secs)
    ranks = [h.start_replica(n, ranks=2) for n in "ab"]
    sync = [dl.start_replica(n) for n in "ab"]
    for r in [*ranks, *sync]:
        r.finish()
    audit_job(h, 8, dataset_size=dataset_size(hf, "pretrain"))
    assert_same_files(ranks, 8)
    audit_job(dl, 4, dataset_size=dataset_size(hf, "pretrain"))  # rounds of H = 4 steps
    assert_same_files(sync, 4)


def test_decoupled_diloco_trains_the_hf_model(hf: HF, tmp_path: Path):
    """Two decoupled DiLoCo slots (no network between them) meet through a storage
    root every 4 inner steps, on the Qwen2, and end with the same parameters."""
    import threading

    # transformers resolves its lazy names on first use, which two threads racing
    # for them can break (ImportError): resolve them here first.
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    from phalanx.jobs.diloco_slot import DecoupledReplica

    secs = sections(hf, steps=12)
    secs["diloco"] = {
        "mode": "objectstore", "url": f"file://{tmp_path / 'rounds'}", "sync_every": 4,
        "replicas": 2, "min_replicas": 2, "grace_s": 0,
    }  # fmt: skip
    cfg = load_config(write_job_toml(tmp_path / "job.toml", secs), [])
    outs = {n: tmp_path / f"{n}.safetensors" for n in ("r0", "r1")}
    errors: list[BaseException] = []

    def slot(name: str) -> None:
        try:
            DecoupledReplica(cfg, name).run(outs[name])
        except BaseException as e:  # surfaced below, in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=slot, args=(n,)) for n in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    from safetensors.torch import load_file

    a, b = (load_file(str(p)) for p in outs.values())
    assert a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) for k in a if k.startswith("global.")
    )


def test_a_checkpoint_of_3_replicas_of_2_ranks_loads_into_2_of_1_bit_identical(
    hf: HF, tmp_path: Path, jobs: list[FTJob]
):
    url = f"file://{tmp_path / 'ckpt'}"
    ckpt = {"url": url, "every_steps": 4, "async_save": False}
    first = sections(hf, steps=4)
    first["roles.policy"]["n_init_replicas"] = 3
    saver = start_job(
        tmp_path, jobs, "saver", first | {"replica": {"ranks": 2}, "checkpoint": ckpt}
    )
    for r in [saver.start_replica(n, ranks=2) for n in "abc"]:
        r.finish()
    # The same checkpoint, exported whole (every shard of every rank), as the truth.
    whole = tmp_path / "export.safetensors"
    p = subprocess.run(
        [sys.executable, "-m", "phalanx.cli", "ckpt", "export", url, "--format", "safetensors",
         str(whole)],
        capture_output=True, text=True, env=child_env(), timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    from safetensors.torch import load_file

    saved = load_file(str(whole))
    # 2 replicas of 1 rank resume from it: with the job at its last step already they
    # only load it and write it back, which must be the saved bits.
    second = sections(hf, steps=4)
    second["roles.policy"]["n_init_replicas"] = 2
    loader = start_job(tmp_path, jobs, "loader", second | {"checkpoint": ckpt})
    loaded = [loader.start_replica(n).finish() for n in "de"]
    for st in loaded:
        model = {k.removeprefix("model."): v for k, v in st.items() if k.startswith("model.")}
        assert model.keys() == saved.keys()
        for k, v in model.items():
            assert torch.equal(v, saved[k]), k
    # And training goes on from it.
    go_on = sections(hf, steps=6)
    go_on["roles.policy"]["n_init_replicas"] = 2
    on = start_job(tmp_path, jobs, "go-on", go_on | {"checkpoint": ckpt})
    rs = [on.start_replica(n) for n in "de"]
    for r in rs:
        r.finish()
    assert {e["step"] for r in rs for e in r.steps()} == {5, 6}


def test_own_loop_under_chaos_trains_every_step_once(tmp_path: Path):
    """examples/own_loop.py started by phalanx run, a replica SIGKILLed every 3 s."""
    run = tmp_path / "run"
    args = [sys.executable, "-m", "phalanx.cli", "run", str(ROOT / "examples" / "own_loop.toml")]
    args += ["--plain", "--json", "--run-dir", str(run), "--chaos", "kill-every=3"]
    args += ["--train.steps", "1500", "--train.log_samples", "true"]
    p = run_to_end(args, 900, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-3000:] + p.stdout[-3000:]
    # The last line is the audit that ends a --chaos run (phalanx.audit): every step
    # 1..1500 committed once (its printers agree on quorum, participants, cursor and
    # loss), each global batch the sampler's (a step short of a share: at most one per
    # replica killed), and the final files identical.
    out = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    summary = next(e for e in out if e["event"] == "summary")
    audit = next(e for e in out if e["event"] == "audit")
    assert audit["ok"], audit
    assert summary["ok"] and summary["steps"] == 1500 and summary["kills"] >= 1, summary
    assert not summary["rollbacks"], summary  # each step in one quorum
    verdicts = {c["check"]: c["verdict"] for c in audit["checks"]}
    want = ("steps.once", "steps.order", "steps.complete", "data.samples", "final.same")
    assert all(verdicts[k] == "pass" for k in want), audit


def test_bad_model_and_data_are_one_line(hf: HF, tmp_path: Path, capsys):
    not_lm = tmp_path / "not-a-model"
    not_lm.mkdir()
    (not_lm / "config.json").write_text(
        json.dumps({"model_type": "bert", "architectures": ["BertModel"]})
    )
    cases = {
        "model dir with no config": (
            ["--train.model.path", str(tmp_path / "nowhere")],
            "train.model.path",
        ),
        "not a causal LM": (["--train.model.path", str(not_lm)], "causal LM"),
        "no such data": (
            ["--train.data.path", str(tmp_path / "none.jsonl")],
            "must be an existing file",
        ),
        "a missing field": (["--train.data.text_field", "body"], "body"),
        "longer than the context": (["--train.data.seq_len", "4096"], "4096"),
        "cuda on a CPU machine": (["--train.device", "cuda"], "train.device"),
    }
    config = write_job_toml(tmp_path / "job.toml", sections(hf))
    from phalanx import cli

    # In this process (each case fails before any network or training): the exit code
    # and stderr a user sees, without a torch start-up per case.
    for what, (extra, says) in cases.items():
        if what == "cuda on a CPU machine" and torch.cuda.is_available():
            continue
        argv = ["replica", "--config", str(config), "--name", "x"]
        argv += ["--controller", str(tmp_path / "no-controller"), *extra]
        code = cli.main(argv)
        err = capsys.readouterr().err.strip()
        assert code == 78, (what, code, err[-2000:])
        # The error is the last line, whole (progress logs may come before it).
        last = err.splitlines()[-1]
        assert "Traceback" not in err and last.startswith("phalanx replica x: "), (what, err)
        assert says in last, (what, err)


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.parametrize("plane", ["gloo", "nccl"])
def test_the_hf_job_on_cuda(hf: HF, tmp_path: Path, jobs: list[FTJob], plane: str):
    """On a GPU machine: 2 replicas on CUDA, over gloo with CUDA tensors (the two may
    share one GPU) or over NCCL (one GPU each, so it needs two), one SIGKILLed and
    restarted: it heals and the job trains the sampler's batches."""
    if plane == "nccl" and _gpus() < 2:
        pytest.skip(f"NCCL needs a GPU per replica: this machine has {_gpus()}")
    secs = sections(hf, steps=STEPS, step_delay_s=0.05, device="cuda", data_plane=plane)
    secs["roles.policy"]["n_init_replicas"] = 2
    job = start_job(tmp_path, jobs, plane, secs)
    # One GPU per replica with NCCL (each process sees its own); both on GPU 0 with gloo.
    gpu = {"a": "0", "b": "1" if plane == "nccl" else "0"}
    a = job.start_replica("a", env={"CUDA_VISIBLE_DEVICES": gpu["a"]})
    b = job.start_replica("b", env={"CUDA_VISIBLE_DEVICES": gpu["b"]})
    back = job.start_replica("b", spare=True, env={"CUDA_VISIBLE_DEVICES": gpu["b"]})
    b.wait_step(4)
    b.signal(signal.SIGKILL)
    b.popen.wait(30)
    a.wait_step(8)
    back.release()
    for r in (a, back):
        r.finish()
    audit_job(job, STEPS, dataset_size=dataset_size(hf, "pretrain"))
    assert back.steps()[0]["healed"]
    assert_same_files([a, back], STEPS)
    assert all(e["peak_mem_mb"] > 0 for e in a.steps())

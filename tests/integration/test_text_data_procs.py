"""Replicas that start at once share one tokenization (phalanx.data.cache): real
processes race for the cache entry's lock, one tokenizes, the others wait and read
it, and all of them, a fresh process each, get the same samples as this one."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

from procs import child_env

from phalanx.config.data import DataSection
from phalanx.data.text import load_text_data

WORKER = Path(__file__).parent / "text_data_worker.py"


def make_tokenizer(d: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>", *"abcdefghijklmnopqrstuvwxyz"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )
    fast.save_pretrained(str(d))
    return d


def test_three_processes_tokenize_once_and_read_the_same_samples(tmp_path: Path):
    tok = make_tokenizer(tmp_path / "tok")
    rows = [{"prompt": " ".join("abcdefgh"[i:]), "response": "x y"} for i in range(8)]
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = DataSection(path=str(path), kind="sft", seq_len=16, cache_dir=str(tmp_path / "c"))
    go = tmp_path / "go"

    def ready(r: int) -> str:
        return str(tmp_path / f"ready{r}")

    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(WORKER),
                spec.model_dump_json(),
                str(tok),
                str(tmp_path / f"ready{r}"),
                str(go),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        for r in range(3)
    ]
    try:
        deadline = time.monotonic() + 300  # imports on a loaded machine, not a margin
        while not all(Path(ready(r)).exists() for r in range(3)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.05)
        go.touch()
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    got = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert sorted(g["calls"] for g in got) == [0, 0, 2]  # one replica: prompts and responses
    data = load_text_data(spec, tok)  # this process, from the cache the others built
    ids, labels = data.batch(range(len(data)))
    mine = hashlib.sha256(ids.numpy().tobytes() + labels.numpy().tobytes()).hexdigest()
    assert {g["digest"] for g in got} == {mine} and got[0]["samples"] == 8

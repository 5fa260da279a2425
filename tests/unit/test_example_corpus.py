"""The example corpus and model: examples/make_corpus.py on a small fake stdlib (one
row per valid source file, the split by file deterministic, site-packages and broken
files left out; the result reads as [train.data]), and examples/make_model.py
--corpus (a Qwen2 directory that AutoTokenizer and AutoModelForCausalLM load, whose
loaded tokenizer cuts text as the one it trained)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from textdata import make_tokenizer

from phalanx.config.data import DataSection
from phalanx.data.text import load_text_data

EXAMPLES = Path(__file__).parents[2] / "examples"


def example(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def make_corpus():
    return example("make_corpus")


def fake_stdlib(root: Path) -> Path:
    files = {f"m{i:02d}.py": f"x = {i}\n" for i in range(30)}
    files |= {
        "pkg/__init__.py": "from pkg import mod\n",
        "site-packages/other.py": "y = 1\n",
        "__pycache__/cached.py": "z = 1\n",
        "test/badsyntax_future.py": "def (:\n",
        "empty.py": "\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "latin1.py").write_bytes(b"# -*- coding: latin-1 -*-\ns = '\xe9'\n")
    return root


def test_the_corpus_is_the_valid_sources_split_by_file(make_corpus, tmp_path):
    lib = fake_stdlib(tmp_path / "lib")
    counts = make_corpus.write(tmp_path / "out", 0.2, lib)
    rows = {
        s: [json.loads(line) for line in (tmp_path / "out" / f"{s}.jsonl").read_text().splitlines()]
        for s in ("train", "validation")
    }
    paths = {s: [r["path"] for r in rows[s]] for s in rows}
    assert sorted(paths["train"] + paths["validation"]) == sorted(
        [f"m{i:02d}.py" for i in range(30)] + ["pkg/__init__.py"]
    )
    assert paths["validation"] == sorted(paths["validation"])  # in sorted order
    assert all(make_corpus.held_out(p, 0.2) for p in paths["validation"])
    assert not any(make_corpus.held_out(p, 0.2) for p in paths["train"])
    assert 0 < len(paths["validation"]) < len(paths["train"])
    assert counts["skipped"][0] == 3  # broken syntax, not UTF-8, empty
    assert rows["train"][0]["text"] == (lib / paths["train"][0]).read_text()
    again = make_corpus.write(tmp_path / "again", 0.2, lib)
    assert again == counts
    assert (tmp_path / "again" / "validation.jsonl").read_bytes() == (
        tmp_path / "out" / "validation.jsonl"
    ).read_bytes()
    tok = make_tokenizer(tmp_path / "tok")
    spec = DataSection(
        path=str(tmp_path / "out" / "train.jsonl"),
        validation=str(tmp_path / "out" / "validation.jsonl"),
        seq_len=4,
        cache_dir=str(tmp_path / "cache"),
    )
    val = load_text_data(spec, tok, split="validation")
    assert val.rows == len(paths["validation"]) and val.skipped == 0


def test_make_model_writes_a_qwen2_directory_whose_tokenizer_loads_as_trained(
    make_corpus, tmp_path, monkeypatch, capsys
):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lib = fake_stdlib(tmp_path / "lib")
    (lib / "more.py").write_text("def caf\u00e9(s):\n    return s.strip()  # it's done\n" * 20)
    make_corpus.write(tmp_path / "corpus", 0.2, lib)
    out = tmp_path / "model"
    args = f"--corpus {tmp_path / 'corpus'} {out} --vocab 300 --hidden 32 --layers 1 --heads 2"
    monkeypatch.setattr("sys.argv", ["make_model.py", *args.split(), "--max-len", "64"])
    assert example("make_model").main() == 0
    assert "wrote a qwen2 model of" in capsys.readouterr().out
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.num_key_value_heads == 2 and model.config.vocab_size >= len(tok)
    # transformers rebuilds a Qwen2 tokenizer with its own split: it must be the trained one.
    text = (lib / "more.py").read_text()
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok(text, add_special_tokens=False)["input_ids"] == raw.encode(text).ids
    assert (
        tok.eos_token == "<eos>" and tok.pad_token == "<pad>" and len(tok) == len(raw.get_vocab())
    )

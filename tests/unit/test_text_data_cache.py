"""The tokenization cache of phalanx.data.text (a restarted replica tokenizes nothing;
replicas that start at once tokenize once; another tokenizer is another entry), rows
left out and counted, bad input in one line, and the ``[train.data]`` section."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from pydantic import ValidationError
from textdata import EOS, counting_calls, ids, make_tokenizer, write_jsonl

from phalanx import env
from phalanx.config import load_config
from phalanx.config.data import DataSection
from phalanx.config.file import ConfigError
from phalanx.data.cache import cache_root
from phalanx.data.text import DataError, TextData, load_text_data

DOCS = [{"text": " ".join("abcdefghijklmnopqrstuvwxyz"[i : i + 5])} for i in range(20)]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture
def docs(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "docs.jsonl", DOCS)


def spec(path: Path, cache: Path, **kw) -> DataSection:
    return DataSection(path=str(path), cache_dir=str(cache), **kw)


def test_a_restarted_replica_reads_the_cache_and_tokenizes_nothing(tok, docs, tmp_path):
    s = spec(docs, tmp_path / "cache", seq_len=8)
    with counting_calls() as calls:
        first = load_text_data(s, tok)
    assert calls[0] > 0
    meta = first.path / "meta.json"
    stamp = meta.stat().st_mtime_ns
    with counting_calls() as calls:
        again = load_text_data(s, tok)
    assert calls[0] == 0 and meta.stat().st_mtime_ns == stamp and again.path == first.path
    assert again.batch([3, 1])[0].tolist() == first.batch([3, 1])[0].tolist()
    assert json.loads(meta.read_text())["samples"] == len(first) == 20 * 6 // 8


def test_replicas_that_load_at_once_tokenize_once_and_read_the_same(tok, docs, tmp_path):
    s = spec(docs, tmp_path / "cache", seq_len=8)
    start = threading.Barrier(3)
    got: dict[int, TextData] = {}

    def replica(r: int) -> None:
        start.wait()
        got[r] = load_text_data(s, tok)

    # Each call is slowed so that the three loads overlap while one of them tokenizes.
    with counting_calls(delay_s=0.3) as calls:
        threads = [threading.Thread(target=replica, args=(r,)) for r in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert sorted(got) == [0, 1, 2]
    assert calls[0] == 1  # one batch of documents, tokenized by one replica only
    rows = [got[r].batch(range(len(got[r])))[0].tolist() for r in range(3)]
    assert rows[0] == rows[1] == rows[2]
    assert not list((tmp_path / "cache").glob(".tmp-*"))


def test_another_tokenizer_or_setting_is_another_entry(tok, docs, tmp_path):
    base = load_text_data(spec(docs, tmp_path / "cache", seq_len=8), tok)
    other_tok = make_tokenizer(tmp_path / "tok2", extra=["more"])
    other = load_text_data(spec(docs, tmp_path / "cache", seq_len=8), other_tok)
    longer = load_text_data(spec(docs, tmp_path / "cache", seq_len=10), tok)
    assert len({base.path, other.path, longer.path}) == 3
    docs.write_text(docs.read_text() + json.dumps({"text": "x y z"}) + "\n")  # data changed
    grown = load_text_data(spec(docs, tmp_path / "cache", seq_len=8), tok)
    assert grown.path != base.path and grown.rows == base.rows + 1


def test_a_damaged_entry_is_built_again(tok, docs, tmp_path):
    s = spec(docs, tmp_path / "cache", seq_len=8)
    first = load_text_data(s, tok)
    (first.path / "input_ids.npy").unlink()
    with counting_calls() as calls:
        again = load_text_data(s, tok)
    assert calls[0] > 0 and again.path == first.path and len(again) == len(first)


def test_the_cache_root_follows_the_setting_then_the_run_dir(monkeypatch, tmp_path):
    monkeypatch.setenv(env.RUN_DIR, str(tmp_path / "run"))
    assert cache_root("") == tmp_path / "run" / "data-cache"
    assert cache_root(str(tmp_path / "mine")) == tmp_path / "mine"
    monkeypatch.delenv(env.RUN_DIR)
    assert cache_root("") == Path.home() / ".cache" / "phalanx" / "data"


def test_rows_that_cannot_be_tokenized_are_left_out_counted_and_reported(
    tok, tmp_path, caplog: pytest.LogCaptureFixture
):
    rows = [
        {"prompt": "a", "response": "b"},
        {"prompt": "a"},
        {"prompt": "", "response": "b"},
        {"prompt": "a b c d e f", "response": "g"},
        {"prompt": "c", "response": "d"},
        {"prompt": "a", "response": "   "},
    ]
    path = write_jsonl(tmp_path / "sft.jsonl", rows)
    with caplog.at_level("WARNING"):
        data = load_text_data(spec(path, tmp_path / "cache", kind="sft", seq_len=6), tok)
    assert (len(data), data.skipped, data.rows) == (2, 4, 6)
    assert data.skipped_reasons == [
        "row 2: response is missing",
        "row 3: prompt is empty",
        "row 4: 8 tokens, more than seq_len 6",
        "row 6: response is empty",
    ]
    (line,) = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert line == (
        f"{path} (train split): 4 row(s) left out of 6: row 2: response is missing, row 3: "
        f"prompt is empty, row 4: 8 tokens, more than seq_len 6, row 6: response is empty"
    )
    # Text files that are not UTF-8 or are blank are left out the same way.
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.txt").write_bytes(b"a b \xff")
    (texts / "b.txt").write_text("c d")
    (texts / "c.txt").write_text("\n")
    data = load_text_data(spec(texts, tmp_path / "cache", seq_len=3), tok)
    assert data.skipped_reasons == [
        "file a.txt: text is not UTF-8 text",
        "file c.txt: text is empty",
    ]
    assert data.batch([0])[0].tolist() == [[*ids("c d"), EOS]]


def bad_inputs(tmp: Path, tok: Path) -> list[tuple[dict, dict, str]]:
    """(settings, load_text_data keywords, what the one line says)."""
    docs = write_jsonl(tmp / "docs.jsonl", DOCS)
    mixed = tmp / "mixed"
    mixed.mkdir()
    write_jsonl(mixed / "a.jsonl", DOCS)
    (mixed / "b.txt").write_text("a b")
    odd = tmp / "odd"
    odd.mkdir()
    (odd / "a.csv").write_text("text\na b\n")
    nochat = make_tokenizer(tmp / "nochat", chat=False)
    chats = write_jsonl(tmp / "chat.jsonl", [{"messages": [{"role": "assistant", "content": "a"}]}])
    import datasets

    datasets.DatasetDict({"a": datasets.Dataset.from_list(DOCS)} | {"b": datasets.Dataset.from_list(DOCS)}).save_to_disk(str(tmp / "dd"))  # fmt: skip
    return [
        ({"path": str(tmp / "nope")}, {}, "train.data.path must be an existing file or directory"),
        ({"path": str(docs), "text_field": "body"}, {}, "its fields are ['text']"),
        ({"path": str(docs), "kind": "sft"}, {}, "its fields are ['text']"),
        ({"path": str(docs), "seq_len": 2048}, {"max_positions": 1024}, "model's context"),
        ({"path": str(mixed)}, {}, "must hold files of one format: got json (a.jsonl, ...)"),
        ({"path": str(odd)}, {}, "must hold files of a known format"),
        ({"path": str(odd / "a.csv")}, {}, "must end in one of"),
        ({"path": str(docs), "seq_len": 4096}, {}, "must hold at least seq_len = 4096 tokens"),
        ({"path": str(docs)}, {"split": "validation"}, "to load the validation split"),
        (
            {"path": str(docs), "validation_fraction": 0.01},
            {"split": "validation"},
            "validation_fraction 0.01 of 20 rows gives it none",
        ),
        ({"path": str(docs), "validation": "nope"}, {"split": "validation"}, "existing file"),
        ({"path": str(tmp / "dd")}, {}, "with a 'train' split (or a single split): got splits"),
        ({"path": str(tmp / "dd"), "validation": "c"}, {"split": "validation"}, "splits are"),
        ({"path": str(docs), "format": "disk"}, {}, "must be a directory written by save_to_disk"),
        ({"path": str(docs)}, {"tokenizer_dir": tmp / "none"}, "must be an existing local"),
        ({"path": str(docs)}, {"tokenizer_dir": tmp}, "must hold a tokenizer"),
        ({"path": str(chats), "kind": "sft"}, {"tokenizer_dir": nochat}, "chat template"),
        (
            {"path": str(write_jsonl(tmp / "bad.jsonl", [{"prompt": 1, "response": "a"}]))},
            {},
            "its fields are ['prompt', 'response']",
        ),
        (
            {"path": str(tmp / "bad.jsonl"), "kind": "sft"},
            {},
            "must hold at least one usable row: got 1 rows, none usable (1 left out, first "
            "row 1: prompt must be a string, got a int)",
        ),
    ]


def test_bad_input_fails_in_one_line(tok, tmp_path):
    for settings, kw, says in bad_inputs(tmp_path, tok):
        kw = {"tokenizer_dir": tok, **kw}
        with pytest.raises(DataError) as e:
            load_text_data(spec(cache=tmp_path / "cache", **settings), kw.pop("tokenizer_dir"), **kw)  # fmt: skip
        assert says in str(e.value) and "\n" not in str(e.value), (settings, str(e.value))
    assert not list((tmp_path / "cache").glob("*/meta.json"))  # nothing cached on failure


def test_the_data_section_checks_its_fields_together(tmp_path):
    cases = [
        ({"validation": "v.jsonl", "validation_fraction": 0.1}, "validation_fraction must be 0"),
        ({"val_every": 10}, "val_every needs a validation set"),
        ({"kind": "sft", "format": "text"}, "must not be 'text' when train.data.kind is 'sft'"),
        ({"kind": "sft", "prompt_field": "x", "response_field": "x"}, "must differ"),
        ({"validation_fraction": 0.6}, "less than or equal to 0.5"),
        ({"seq_len": 0}, "greater than or equal to 1"),
    ]
    for fields, says in cases:
        with pytest.raises(ValidationError, match=says):
            DataSection(path="d.jsonl", **fields)
    cfg = tmp_path / "job.toml"
    model = '[train.model]\npath = "m"\n'
    cfg.write_text(
        model + '[train.data]\npath = "d.jsonl"\nval_every = 5\nvalidation_fraction = 0.1\n'
    )
    data = load_config(cfg).train.data
    assert data is not None and data.has_validation and data.seq_len == 512
    cfg.write_text(model + '[train.data]\npath = "d.jsonl"\nval_every = 5\n')
    with pytest.raises(ConfigError, match=r"train\.data\.val_every needs a validation set"):
        load_config(cfg)
    cfg.write_text("[train]\nsteps = 3\n")
    assert load_config(cfg).train.data is None

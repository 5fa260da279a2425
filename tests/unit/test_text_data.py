"""Training data for Hugging Face models (phalanx.data.text): every format reads the
same rows, pretraining packs documents into exact samples, SFT masks prompts and
padding (prompt/response and chat templates), and validation splits by fraction
(deterministic, disjoint) or by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from textdata import EOS, PAD, ids, make_tokenizer, write_all_formats, write_jsonl

from phalanx.config.data import DataSection
from phalanx.data.text import TextData, held_out, load_text_data

DOCS = ["a b c", "d e", "f g h i j", "k"]
STREAM = [t for d in DOCS for t in [*ids(d), EOS]]  # 15 tokens


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def load(tok: Path, cache: Path, **kw) -> TextData:
    split = kw.pop("split", "train")
    seed = kw.pop("seed", 0)
    return load_text_data(DataSection(cache_dir=str(cache), **kw), tok, split=split, seed=seed)


def rows_of(data: TextData) -> list[list[int]]:
    return data.batch(range(len(data)))[0].tolist()


def test_pretraining_packs_documents_with_an_eos_each_into_exact_samples(tok, tmp_path):
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": d} for d in DOCS])
    data = load(tok, tmp_path / "cache", path=str(path), seq_len=4)
    assert len(data) == 3  # 15 tokens: the last partial sample is dropped
    x, y = data.batch([2, 0])
    assert x.dtype == y.dtype == torch.int64 and x.shape == (2, 4)
    assert x.tolist() == [STREAM[8:12], STREAM[0:4]]
    assert torch.equal(x, y)  # the model shifts labels itself
    assert data.loss_tokens([2, 0]) == 2 * 3
    assert (data.skipped, data.tokens, data.eos_id) == (0, 12, EOS)
    # A pure function of (files, tokenizer, settings, i): a fresh cache recomputes it alike.
    again = load(tok, tmp_path / "other-cache", path=str(path), seq_len=4)
    assert again.path != data.path and rows_of(again) == rows_of(data)


def test_every_format_reads_the_same_rows_in_the_same_order(tok, tmp_path):
    paths = write_all_formats(tmp_path / "data", [{"text": d} for d in DOCS])
    want = [STREAM[i : i + 3] for i in range(0, 15, 3)]
    for name, path in paths.items():
        data = load(tok, tmp_path / "cache", path=str(path), seq_len=3)
        assert rows_of(data) == want, name
    one = tmp_path / "one.txt"
    one.write_text("a b c d\ne f")  # a text file is one document, newlines and all
    assert rows_of(load(tok, tmp_path / "cache", path=str(one), seq_len=7)) == [
        [*ids("a b c d e f"), EOS]
    ]


def test_a_directory_of_any_files_reads_as_text_when_told(tok, tmp_path):
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "mod.py").write_text("c d")
    (src / "a.py").write_text("a b")
    (src / ".hidden.py").write_text("z z z")
    data = load(tok, tmp_path / "cache", path=str(src), format="text", seq_len=6)
    assert rows_of(data) == [[*ids("a b"), EOS, *ids("c d"), EOS]]  # sorted, hidden skipped


def test_json_columns_other_than_the_text_field_are_ignored(tok, tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"body": d, "id": i} for i, d in enumerate(DOCS)])
    data = load(tok, tmp_path / "cache", path=str(path), text_field="body", seq_len=5)
    assert rows_of(data) == [STREAM[0:5], STREAM[5:10], STREAM[10:15]]


def test_sft_masks_the_prompt_and_the_padding(tok, tmp_path):
    rows = [{"prompt": "a b", "response": "c d"}, {"prompt": "e", "response": "f g h"}]
    path = write_jsonl(tmp_path / "sft.jsonl", rows)
    data = load(tok, tmp_path / "cache", path=str(path), kind="sft", seq_len=7)
    x, y = data.batch([0, 1])
    assert x.tolist() == [
        [*ids("a b c d"), EOS, PAD, PAD],
        [*ids("e f g h"), EOS, PAD, PAD],
    ]
    m = -100
    assert y.tolist() == [
        [m, m, *ids("c d"), EOS, m, m],
        [m, *ids("f g h"), EOS, m, m],
    ]
    assert data.loss_tokens([0, 1]) == int((y[:, 1:] != m).sum()) == 7
    assert data.loss_tokens([1, 1, 0]) == 11


def test_chat_rows_go_through_the_template_with_the_loss_on_the_last_message(tok, tmp_path):
    def chat(*turns: tuple[str, str]) -> dict:
        return {"messages": [{"role": r, "content": c} for r, c in turns]}

    rows = [
        chat(("system", "s"), ("user", "a b"), ("assistant", "c")),
        chat(("user", "a"), ("assistant", "z y")),  # rendered under another header
        chat(("user", "a"), ("assistant", "b"), ("user", "c")),  # not the assistant's
        chat(("user", "a b c d e f g h i j k l"), ("assistant", "i")),  # longer than seq_len
        {"messages": "a b"},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    data = load(tok, tmp_path / "cache", path=str(path), kind="sft", seq_len=16)
    assert len(data) == 1 and data.skipped == 4 and data.rows == 5
    reasons = data.skipped_reasons
    assert (
        reasons[0] == "row 2: the chat template's prompt does not tokenize to a prefix of the chat"
    )
    assert reasons[1] == "row 3: messages must end with the assistant's message: got role 'user'"
    assert reasons[2] == "row 4: 19 tokens, more than seq_len 16"
    assert reasons[3].startswith("row 5: messages must be a non-empty list")
    x, y = data.batch([0])
    prompt = ["<|im_start|>", "system", "s", "<|im_end|>", "<|im_start|>", "user", "a", "b"]
    prompt += ["<|im_end|>", "<|im_start|>", "assistant"]
    answer = ["c", "<|im_end|>"]
    want = [ids_of(w) for w in prompt + answer]
    assert x[0, : len(want)].tolist() == want and x[0, len(want) :].eq(PAD).all()
    assert y[0, len(prompt) : len(want)].tolist() == want[len(prompt) :]  # no EOS added
    assert y[0, : len(prompt)].eq(-100).all() and y[0, len(want) :].eq(-100).all()


def ids_of(word: str) -> int:
    from textdata import VOCAB

    return VOCAB[word]


def test_rows_mixing_chats_and_prompt_pairs(tok, tmp_path):
    rows = [
        {"messages": None, "prompt": "a", "response": "b"},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
    ]
    path = write_jsonl(tmp_path / "mix.jsonl", rows)
    data = load(tok, tmp_path / "cache", path=str(path), kind="sft", seq_len=12)
    assert len(data) == 2 and data.skipped == 0
    assert data.batch([0])[0][0, :3].tolist() == [*ids("a b"), EOS]


def test_validation_by_fraction_is_deterministic_and_disjoint_from_train(tok, tmp_path):
    words = "abcdefghijklmnopqrstuvwxyz"
    rows = [{"prompt": a, "response": b} for a in words[:8] for b in words[:5]]
    path = write_jsonl(tmp_path / "rows.jsonl", rows)
    spec = dict(path=str(path), kind="sft", seq_len=4, validation_fraction=0.25)
    train = load(tok, tmp_path / "c1", seed=7, **spec)
    val = load(tok, tmp_path / "c1", seed=7, split="validation", **spec)
    both = [tuple(r[:2]) for r in rows_of(train) + rows_of(val)]
    assert sorted(both) == sorted(tuple(ids(f"{r['prompt']} {r['response']}")) for r in rows)
    assert 0 < len(val) < len(train) and train.rows + val.rows == len(rows)
    held = [i for i in range(len(rows)) if held_out(7, i, 0.25)]
    assert [tuple(r[:2]) for r in rows_of(val)] == [
        tuple(ids(f"{rows[i]['prompt']} {rows[i]['response']}")) for i in held
    ]
    # The same in a fresh cache (a pure function), and another seed holds out others.
    assert rows_of(load(tok, tmp_path / "c2", seed=7, split="validation", **spec)) == rows_of(val)
    other = load(tok, tmp_path / "c1", seed=8, split="validation", **spec)
    assert rows_of(other) != rows_of(val)


def test_pretraining_validation_by_fraction_holds_out_whole_documents(tok, tmp_path):
    docs = [{"text": " ".join("abcdefghij"[i:] + "k")} for i in range(10)]
    path = write_jsonl(tmp_path / "docs.jsonl", docs)
    spec = dict(path=str(path), seq_len=2, validation_fraction=0.3)
    train = load(tok, tmp_path / "c", seed=1, **spec)
    val = load(tok, tmp_path / "c", seed=1, split="validation", **spec)
    held = [i for i in range(10) if held_out(1, i, 0.3)]
    kept = [i for i in range(10) if i not in held]
    stream = [t for i in held for t in [*ids(docs[i]["text"]), EOS]]
    assert [t for r in rows_of(val) for t in r] == stream[: len(stream) // 2 * 2]
    assert (val.rows, train.rows) == (len(held), len(kept))


def test_validation_by_split_name_and_by_path(tok, tmp_path):
    paths = write_all_formats(tmp_path / "data", [{"text": d} for d in DOCS])
    val = load(tok, tmp_path / "c", path=str(paths["dict"]), validation="validation",
               split="validation", seq_len=2)  # fmt: skip
    assert rows_of(val) == [STREAM[0:2], STREAM[2:4]]  # the validation split: DOCS[0]
    held = write_jsonl(tmp_path / "held.jsonl", [{"text": "x y z"}])
    val = load(tok, tmp_path / "c", path=str(paths["jsonl"]), validation=str(held),
               split="validation", seq_len=4)  # fmt: skip
    assert rows_of(val) == [[*ids("x y z"), EOS]]
    train = load(tok, tmp_path / "c", path=str(paths["jsonl"]), validation=str(held), seq_len=4)
    assert len(train) == 3  # the validation path takes nothing away from train

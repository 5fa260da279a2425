"""Tokenizers: the built-in character tokenizer and the local HF loader."""

from __future__ import annotations

import pytest

from phalanx.rl.tokenizer import CharTokenizer, HFTokenizer, load_tokenizer


def test_char_round_trip():
    tok = CharTokenizer()
    ids = tok.encode("3142>")
    assert ids[0] == tok.bos_id
    assert len(ids) == 6
    assert tok.decode(ids) == "3142>"
    assert tok.decode([*tok.encode("1234")[1:], tok.eos_id, tok.pad_id]) == "1234"
    assert tok.vocab_size == 14
    assert len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3
    assert all(0 <= i < tok.vocab_size for i in tok.encode("0123456789>"))


def test_char_errors_say_what_to_fix():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match=r"got 'x' at position 2"):
        tok.encode("12x")
    with pytest.raises(ValueError, match=r"token id must be in \[0, 14\): got 99"):
        tok.decode([99])
    with pytest.raises(ValueError, match="distinct characters"):
        CharTokenizer("aa")


def test_load_tokenizer_defaults_to_char():
    assert isinstance(load_tokenizer(None), CharTokenizer)


def test_hf_tokenizer_from_local_path(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "hello": 4, "world": 5}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )
    fast.save_pretrained(tmp_path)

    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.vocab_size) == (0, 1, 2, 6)
    ids = tok.encode("hello world")
    assert ids == [1, 4, 5]
    assert tok.decode([*ids, tok.eos_id, tok.pad_id]) == "hello world"


def test_hf_tokenizer_missing_path_is_clear(tmp_path):
    with pytest.raises(ValueError, match="must be an existing local directory"):
        load_tokenizer(tmp_path / "nope")

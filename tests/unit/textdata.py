"""Helpers of the text-data tests: a tiny word-level tokenizer saved as a Hugging Face
directory (no network), rows written in each format, and a counter of tokenizer calls."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>"]
WORDS = [*"abcdefghijklmnopqrstuvwxyz", "user", "assistant", "system", "reasoner"]
VOCAB = {w: i for i, w in enumerate(SPECIALS + WORDS)}
PAD, EOS = VOCAB["<pad>"], VOCAB["<eos>"]
CHATML = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m['content'].startswith('z') %}<|im_start|>reasoner\n"
    "{% else %}<|im_start|>{{ m['role'] }}\n{% endif %}"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML, except that an assistant message starting with ``z`` is rendered under
another header (as reasoning templates rewrite a turn): its prompt is not a prefix."""


def ids(text: str) -> list[int]:
    """The tiny tokenizer's ids of whitespace-separated words."""
    return [VOCAB.get(w, VOCAB["<unk>"]) for w in text.split()]


def make_tokenizer(d: Path, chat: bool = True, extra: list[str] | None = None) -> Path:
    """A word-level tokenizer (whitespace split) saved at ``d``; ``extra`` words make
    it another tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = dict(VOCAB)
    for w in extra or []:
        vocab.setdefault(w, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    if chat:
        fast.chat_template = CHATML
    fast.save_pretrained(str(d))
    return d


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_all_formats(d: Path, rows: list[dict[str, str]]) -> dict[str, Path]:
    """The same rows (a ``text`` field) as every format the loader reads."""
    import datasets

    d.mkdir(parents=True, exist_ok=True)
    out = {"jsonl": write_jsonl(d / "rows.jsonl", rows)}
    (d / "rows.json").write_text(json.dumps(rows))
    out["json"] = d / "rows.json"
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(d / "rows.parquet"))
    out["parquet"] = d / "rows.parquet"
    ds.save_to_disk(str(d / "saved"))
    out["disk"] = d / "saved"
    out["arrow"] = next((d / "saved").glob("*.arrow"))
    datasets.DatasetDict({"train": ds, "validation": ds.select([0])}).save_to_disk(str(d / "dd"))
    out["dict"] = d / "dd"
    texts = d / "texts"
    texts.mkdir()
    for i, r in enumerate(rows):  # sorted names keep the rows' order
        (texts / f"doc{i:03d}.txt").write_text(r["text"])
    out["text dir"] = texts
    return out


@contextmanager
def counting_calls(delay_s: float = 0.0) -> Iterator[list[int]]:
    """Count calls of every Hugging Face tokenizer (``__call__`` of the library's base
    class, which is not ours), each slowed by ``delay_s``."""
    import time

    from transformers import PreTrainedTokenizerBase

    calls = [0]
    real = PreTrainedTokenizerBase.__call__

    def counted(self: Any, *a: Any, **kw: Any) -> Any:
        calls[0] += 1
        time.sleep(delay_s)
        return real(self, *a, **kw)

    PreTrainedTokenizerBase.__call__ = counted  # type: ignore[method-assign]
    try:
        yield calls
    finally:
        PreTrainedTokenizerBase.__call__ = real  # type: ignore[method-assign]

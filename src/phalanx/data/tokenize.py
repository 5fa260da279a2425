"""Tokenizing rows into training samples (:mod:`phalanx.data.text` caches the result).

- **pretrain**: each document is tokenized without special tokens and followed by
  one EOS; the documents' tokens are written one after the other, in row order
  (:mod:`phalanx.data.text` cuts them into ``seq_len`` samples).
- **sft**: one sample per row, ``prompt`` tokens then ``response`` tokens then EOS, or
  for a chat (``messages``) the chat template's rendering of the whole conversation,
  whose prompt part (the template of all messages but the last, with the generation
  prompt) must tokenize to a prefix of it. No EOS is added to a chat: the template's
  end-of-turn marker is what the model learns to stop with (as TRL does). A sample's
  loss is on the tokens after the prompt.

A row that cannot be tokenized (a field missing, not a string, empty; a chat that is
not a list of messages ending with the assistant's; an SFT sample longer than
``seq_len``) is left out and counted in a :class:`Skips`, never an exception.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from phalanx.config.data import DataSection
from phalanx.data.errors import DataError, first_line

TOKENIZER_FILE_PREFIXES = (
    "tokenizer",
    "vocab",
    "merges",
    "special_tokens_map",
    "added_tokens",
    "chat_template",
    "spiece",
    "sentencepiece",
)
"""Files of a model directory that make up its tokenizer (its weights and config do not)."""
BATCH_CHARS = 1 << 20
"""Text handed to the tokenizer per call: a batch lets a fast tokenizer use its threads."""

T = TypeVar("T")

Write = Callable[[np.ndarray], None]
"""Takes the next tokens (int32) of the split's token stream."""


class Skips:
    """Rows left out: how many, and the first few reasons."""

    KEEP = 20

    def __init__(self) -> None:
        self.count = 0
        self.reasons: list[str] = []

    def add(self, label: str, why: str) -> None:
        self.count += 1
        if len(self.reasons) < self.KEEP:
            self.reasons.append(f"{label}: {why}")


def tokenizer_identity(directory: Path) -> str:
    """A digest of the tokenizer in ``directory``: its files' names and bytes, the model
    type in its ``config.json``, and the versions of the libraries that run it. Two
    directories with the same digest tokenize alike, so cached tokens are keyed by it.
    Raises :class:`DataError` when the directory holds no tokenizer."""
    if not directory.is_dir():
        raise DataError(
            f"the tokenizer directory must be an existing local directory: got "
            f"{str(directory)!r}. Point train.model at a directory written by save_pretrained."
        )
    files = sorted(
        f for f in directory.iterdir() if f.is_file() and f.name.startswith(TOKENIZER_FILE_PREFIXES)
    )
    if not any(f.name in ("tokenizer.json", "tokenizer_config.json") for f in files):
        raise DataError(
            f"the tokenizer directory must hold a tokenizer (tokenizer.json or "
            f"tokenizer_config.json): got none in {str(directory)!r}. Save one there with "
            f"tokenizer.save_pretrained(dir)."
        )
    h = hashlib.sha256()
    for lib in ("transformers", "tokenizers"):
        h.update(f"{lib}={importlib.metadata.version(lib)}\n".encode())
    # AutoTokenizer picks the class by the model's type, and a class may rebuild the
    # tokenizer from its vocabulary with its own pre-tokenizer (Qwen2Tokenizer does).
    h.update(f"model_type={_model_type(directory)}\n".encode())
    for f in files:
        data = f.read_bytes()
        h.update(f"{f.name}\n{len(data)}\n".encode())
        h.update(data)
    return h.hexdigest()


def _model_type(directory: Path) -> str:
    try:
        return str(json.loads((directory / "config.json").read_text()).get("model_type", ""))
    except (OSError, ValueError, AttributeError):
        return ""


def load_tokenizer(directory: Path) -> Any:
    """``AutoTokenizer.from_pretrained(directory, local_files_only=True)``, which must
    define an EOS token. Raises :class:`DataError` in one line."""
    from phalanx.rl.tokenizer import auto_tokenizer

    try:
        tok = auto_tokenizer(directory)
    except ValueError as e:
        raise DataError(f"the tokenizer directory: {e}") from e
    if tok.eos_token_id is None:
        raise DataError(
            f"the tokenizer in {str(directory)!r} must define an EOS token: got none. Set "
            f"eos_token in its tokenizer_config.json."
        )
    return tok


def special_ids(tok: Any) -> dict[str, int]:
    """EOS, padding (EOS when the tokenizer has none: padding carries no loss) and
    vocabulary size of a tokenizer."""
    eos = int(tok.eos_token_id)
    pad = eos if tok.pad_token_id is None else int(tok.pad_token_id)
    return {"eos_id": eos, "pad_id": pad, "vocab_size": len(tok)}


def text_problem(row: dict[str, Any], field: str) -> str:
    """Why ``row[field]`` cannot be tokenized as text; empty when it can."""
    v = row.get(field)
    if v is None:
        return f"{field} is missing"
    if isinstance(v, bytes):
        return f"{field} is not UTF-8 text"
    if not isinstance(v, str):
        return f"{field} must be a string, got a {type(v).__name__}"
    if not v.strip():
        return f"{field} is empty"
    return ""


def _batches(
    rows: Iterable[tuple[str, T]], chars: Callable[[T], int]
) -> Iterator[list[tuple[str, T]]]:
    """Labelled texts grouped into batches of about :data:`BATCH_CHARS` characters."""
    batch: list[tuple[str, T]] = []
    total = 0
    for item in rows:
        batch.append(item)
        total += chars(item[1])
        if total >= BATCH_CHARS:
            yield batch
            batch, total = [], 0
    if batch:
        yield batch


def _ids(tok: Any, texts: list[str]) -> list[list[int]]:
    return [list(x) for x in tok(texts, add_special_tokens=False)["input_ids"]]


def pretrain(
    tok: Any, rows: Iterable[tuple[str, dict[str, Any]]], field: str, skips: Skips, write: Write
) -> int:
    """Tokenize each labelled row's ``field`` and write the documents' tokens, each
    followed by EOS, in row order. Returns the documents tokenized."""
    eos = int(tok.eos_token_id)
    docs = 0

    def good() -> Iterator[tuple[str, str]]:
        for label, row in rows:
            why = text_problem(row, field)
            if why:
                skips.add(label, why)
            else:
                yield label, row[field]

    for batch in _batches(good(), len):
        out = []
        for ids in _ids(tok, [text for _, text in batch]):
            out.append(np.asarray([*ids, eos], dtype=np.int32))
        write(np.concatenate(out))
        docs += len(batch)
    return docs


def _messages_problem(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        return "must be a non-empty list of {role, content} messages"
    for m in messages:
        if not isinstance(m, dict) or not all(
            isinstance(m.get(k), str) for k in ("role", "content")
        ):
            return "must be a list of {role, content} messages with string values"
    if messages[-1]["role"] != "assistant":
        return f"must end with the assistant's message: got role {messages[-1]['role']!r}"
    return ""


def _sft_texts(tok: Any, row: dict[str, Any], spec: DataSection) -> tuple[str, str, bool] | str:
    """(prompt text, response or whole-chat text, whether a chat) of an SFT row, or why
    it cannot be tokenized."""
    messages = row.get(spec.messages_field)
    if messages is not None:
        why = _messages_problem(messages)
        if why:
            return f"{spec.messages_field} {why}"
        if not getattr(tok, "chat_template", None):
            raise DataError(
                f"the tokenizer must have a chat template for rows with "
                f"train.data.messages_field {spec.messages_field!r}: it has none. Add "
                f"chat_template to its tokenizer_config.json (or chat_template.jinja), or "
                f"give the rows prompt and response fields."
            )
        try:
            prompt = tok.apply_chat_template(
                messages[:-1], tokenize=False, add_generation_prompt=True
            )
            full = tok.apply_chat_template(messages, tokenize=False)
        except Exception as e:  # a template may raise on purpose (roles must alternate)
            return f"the chat template failed: {first_line(e)}"
        return str(prompt), str(full), True
    for field in (spec.prompt_field, spec.response_field):
        why = text_problem(row, field)
        if why:
            return why
    return row[spec.prompt_field], row[spec.response_field], False


def sft(
    tok: Any,
    rows: Iterable[tuple[str, dict[str, Any]]],
    spec: DataSection,
    skips: Skips,
    write: Write,
) -> list[tuple[int, int]]:
    """Tokenize each labelled SFT row and write its sample's tokens, in row order.
    Returns each written sample's (length, prompt length)."""
    eos = int(tok.eos_token_id)
    out: list[tuple[int, int]] = []
    # Rows whose text is bad stay in their batch, so that reasons come in row order.
    texts = ((label, _sft_texts(tok, row, spec)) for label, row in rows)
    for batch in _batches(texts, lambda t: len(t) if isinstance(t, str) else len(t[0] + t[1])):
        good = [t for _, t in batch if not isinstance(t, str)]
        firsts = iter(_ids(tok, [t[0] for t in good]) if good else [])
        seconds = iter(_ids(tok, [t[1] for t in good]) if good else [])
        for label, t in batch:
            if isinstance(t, str):
                skips.add(label, t)
                continue
            p, s, chat = next(firsts), next(seconds), t[2]
            if chat and s[: len(p)] != p:
                skips.add(
                    label, "the chat template's prompt does not tokenize to a prefix of the chat"
                )
                continue
            ids = s if chat else [*p, *s, eos]
            if len(ids) > spec.seq_len:
                skips.add(label, f"{len(ids)} tokens, more than seq_len {spec.seq_len}")
                continue
            if len(ids) == len(p):
                skips.add(label, "the response has no tokens")
                continue
            write(np.asarray(ids, dtype=np.int32))
            out.append((len(ids), len(p)))
    return out

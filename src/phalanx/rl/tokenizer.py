"""Tokenizers behind the small :class:`~phalanx.rl.base.Tokenizer` interface.

- :class:`CharTokenizer`: one id per character, built in code. The built-in
  sort task uses it with the alphabet ``0123456789>``.
- :class:`HFTokenizer`: a Hugging Face tokenizer loaded from a *local* path
  (nothing is downloaded at run time).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from phalanx.config.rl import TaskSection
from phalanx.rl.base import Tokenizer

DIGITS_ALPHABET = "0123456789>"
"""Characters of the built-in sort task: the digits and the prompt separator."""


class CharTokenizer(Tokenizer):
    """A character-level tokenizer: ids 0, 1, 2 are PAD, BOS, EOS; then one id per character."""

    PAD, BOS, EOS = 0, 1, 2
    SPECIALS = ("<pad>", "<bos>", "<eos>")

    def __init__(self, alphabet: str = DIGITS_ALPHABET):
        if not alphabet or len(set(alphabet)) != len(alphabet):
            raise ValueError(
                f"alphabet must be a non-empty string of distinct characters: got {alphabet!r}. "
                f"Remove the repeated characters."
            )
        self.alphabet = alphabet
        self._to_id = {c: i + len(self.SPECIALS) for i, c in enumerate(alphabet)}
        self.vocab_size = len(self.SPECIALS) + len(alphabet)
        self.pad_id, self.bos_id, self.eos_id = self.PAD, self.BOS, self.EOS

    def encode(self, text: str) -> list[int]:
        ids = [self.BOS]
        for pos, c in enumerate(text):
            i = self._to_id.get(c)
            if i is None:
                raise ValueError(
                    f"text must use only characters of the alphabet: got {c!r} at position "
                    f"{pos} of {text!r}, expected one of {self.alphabet!r}. Build the "
                    f"CharTokenizer with an alphabet that covers the task's text."
                )
            ids.append(i)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        n = len(self.SPECIALS)
        out = []
        for i in ids:
            i = int(i)
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"token id must be in [0, {self.vocab_size}): got {i}. The ids do not "
                    f"come from this tokenizer (or the model's vocabulary is larger)."
                )
            if i >= n:
                out.append(self.alphabet[i - n])
        return "".join(out)


class HFTokenizer(Tokenizer):
    """A Hugging Face tokenizer loaded from a local directory.

    ``pad_id`` falls back to ``eos_id`` when the tokenizer has no pad token:
    padding is masked out everywhere, so the two may share an id.
    """

    def __init__(self, tok: Any, chat: bool = False, system_prompt: str | None = None):
        if chat and not getattr(tok, "chat_template", None):
            raise ValueError(
                "task.chat needs a tokenizer with a chat template: this one has none. Add "
                "chat_template to its tokenizer_config.json (or chat_template.jinja), or set "
                "task.chat = false."
            )
        self.chat, self.system_prompt = chat, system_prompt
        if tok.eos_token_id is None:
            raise ValueError(
                "tokenizer must define an EOS token: got eos_token_id=None. Set eos_token "
                "in the tokenizer's files (tokenizer_config.json / special_tokens_map.json)."
            )
        self.tok = tok
        self.vocab_size = len(tok)
        self.eos_id = int(tok.eos_token_id)
        self.pad_id = int(tok.pad_token_id) if tok.pad_token_id is not None else self.eos_id
        self.bos_id = int(tok.bos_token_id) if tok.bos_token_id is not None else None

    @classmethod
    def from_path(
        cls, path: str | Path, chat: bool = False, system_prompt: str | None = None
    ) -> HFTokenizer:
        """Load with ``AutoTokenizer.from_pretrained(path, local_files_only=True)``."""
        p = Path(path)
        try:
            return cls(auto_tokenizer(p), chat, system_prompt)
        except ValueError as e:
            raise ValueError(f"task.tokenizer_path {str(p)!r}: {e}") from e

    def encode(self, text: str) -> list[int]:
        ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def encode_prompt(self, text: str) -> list[int]:
        if not self.chat:
            return self.encode(text)
        messages = [{"role": "user", "content": text}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        rendered = self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return list(self.tok(rendered, add_special_tokens=False)["input_ids"])

    def vocab(self) -> dict[str, int]:
        return dict(self.tok.get_vocab())

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


def auto_tokenizer(p: Path) -> Any:
    """``AutoTokenizer`` of a local directory; ValueError in one line when it has none."""
    from transformers import AutoTokenizer

    if not p.is_dir():
        raise ValueError(
            f"tokenizer path must be an existing local directory: got {str(p)!r}. Save one "
            f"with tokenizer.save_pretrained(dir); hub names are not fetched."
        )
    try:
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise ValueError(f"{str(p)!r} holds no loadable tokenizer: {first}") from e


def load_tokenizer(
    path: str | Path | None = None, chat: bool = False, system_prompt: str | None = None
) -> Tokenizer:
    """The character tokenizer of the built-in task when ``path`` is None, else a local HF
    one (with the chat template applied to prompts when ``chat``)."""
    if path is None:
        if chat:
            raise ValueError(
                "task.chat needs a tokenizer with a chat template: task.tokenizer_path is "
                "unset (the built-in character tokenizer has none). Set it to the model's "
                "tokenizer directory."
            )
        return CharTokenizer()
    return HFTokenizer.from_path(path, chat, system_prompt)


def task_tokenizer(t: TaskSection) -> Tokenizer:
    """The tokenizer of a job's ``[rl.task]``: its path, chat template and system prompt."""
    return load_tokenizer(t.tokenizer_path, t.chat, t.system_prompt)


def check_same_tokenizer(tok: Tokenizer, model_dir: str | Path) -> None:
    """Raise ValueError in one line when ``model_dir`` holds its own tokenizer and it is
    not ``tok`` (another vocabulary, or another EOS): the engine and the trainer would
    read the same ids as different text."""
    d = Path(model_dir)
    if not any((d / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return  # the model directory holds no tokenizer: nothing to disagree with
    if not isinstance(tok, HFTokenizer):
        raise ValueError(
            f"task.tokenizer_path is unset (the built-in character tokenizer), but model.path "
            f"{str(d)!r} has its own tokenizer: set task.tokenizer_path = {str(d)!r}."
        )
    own = HFTokenizer(auto_tokenizer(d))
    mine, theirs = tok.vocab(), own.vocab()
    if mine != theirs or tok.eos_id != own.eos_id:
        diff = sorted(set(mine.items()) ^ set(theirs.items()))[:1]
        what = f"first difference {diff[0]!r}" if diff else f"EOS {tok.eos_id} vs {own.eos_id}"
        raise ValueError(
            f"task.tokenizer_path and model.path {str(d)!r} must hold the same tokenizer: got "
            f"{len(mine)} and {len(theirs)} tokens, {what}. Use the model's own tokenizer."
        )

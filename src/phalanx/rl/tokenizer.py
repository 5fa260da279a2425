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

    def __init__(self, tok: Any):
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
    def from_path(cls, path: str | Path) -> HFTokenizer:
        """Load with ``AutoTokenizer.from_pretrained(path, local_files_only=True)``."""
        from transformers import AutoTokenizer

        p = Path(path)
        if not p.is_dir():
            raise FileNotFoundError(
                f"tokenizer path must be an existing local directory: got {str(p)!r}. "
                f"Save one with tokenizer.save_pretrained(dir); hub names are not fetched."
            )
        return cls(AutoTokenizer.from_pretrained(str(p), local_files_only=True))

    def encode(self, text: str) -> list[int]:
        ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
        return ([self.bos_id] if self.bos_id is not None else []) + ids

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=True)


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """The character tokenizer of the built-in task when ``path`` is None, else a local HF one."""
    return CharTokenizer() if path is None else HFTokenizer.from_path(path)

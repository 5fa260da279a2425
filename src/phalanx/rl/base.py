"""Interfaces of the RL core: a tokenizer and a task.

Generation engines have their own interface in ``engine/base.py``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any


class Tokenizer(ABC):
    """Text <-> token ids, with the special ids generation and training need.

    ``eos_id`` ends a completion: the engine stops a sequence when it samples it,
    and the EOS token is part of the completion (it is trained on and scored).
    ``pad_id`` only fills batch slots; it is never attended to nor trained on, so
    it may equal ``eos_id`` (as for many HF tokenizers).
    """

    vocab_size: int
    """Number of token ids; the model's vocabulary must be at least this large."""
    pad_id: int
    eos_id: int
    bos_id: int | None
    """Prepended by :meth:`encode` when not None."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, with BOS first when the tokenizer has one; no EOS."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` with special tokens (PAD, BOS, EOS) left out."""

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a task's prompt as the engine gets it: :meth:`encode`, or the
        tokenizer's chat template around it when the task asks for chat prompts."""
        return self.encode(text)


class Task(ABC):
    """Prompts and the reward that scores completions to them.

    Prompts are addressed by index so that any process (a rollout replica, a
    controller handing out prompt leases) gets the same prompt for the same
    index: ``prompt(i)`` must be a pure function of the task's config and ``i``.
    """

    name: str

    @property
    @abstractmethod
    def num_prompts(self) -> int | None:
        """How many distinct prompts there are, or None for an unbounded stream."""

    @abstractmethod
    def prompt(self, index: int) -> str:
        """The prompt text with this index (``index >= 0``); deterministic."""

    @abstractmethod
    def reward(self, prompt: str, completion: str, finished: bool) -> float:
        """Score of ``completion`` (decoded text, without EOS) for ``prompt``.

        ``finished`` is True when the completion ended with EOS and False when
        it was cut off by ``max_new_tokens``.
        """

    @abstractmethod
    def exact_match(self, prompt: str, completion: str, finished: bool) -> bool:
        """Whether the completion is exactly right (reported next to the reward)."""

    def score(self, prompt: str, completion: str, finished: bool) -> tuple[float, bool]:
        """(reward, exact match) of one completion; tasks whose two share work (a
        parse of the answer) compute both at once."""
        return (
            self.reward(prompt, completion, finished),
            self.exact_match(prompt, completion, finished),
        )

    def prompts(self, start: int, count: int) -> list[str]:
        """``count`` consecutive prompts from ``start``, wrapping around a finite task."""
        n = self.num_prompts
        return [self.prompt((start + i) % n if n else start + i) for i in range(count)]


class RowTask(Task):
    """A task over a finite list of rows (dicts), prompt ``i`` being row ``i``'s
    ``prompt_field``."""

    rows: list[dict[str, Any]]
    prompt_field: str = "prompt"

    @property
    def num_prompts(self) -> int | None:
        return len(self.rows)

    def prompt(self, index: int) -> str:
        if not 0 <= index < len(self.rows):
            raise ValueError(
                f"prompt index must be in [0, {len(self.rows)}): got {index}. Use "
                f"Task.prompts(), which wraps around."
            )
        return str(self.rows[index][self.prompt_field])

"""Token-in, token-out: one episode's token ids, exactly as the engine produced them.

An environment speaks in chat messages, and the usual way to train on a
multi-turn conversation is to render the whole conversation through the chat
template and tokenize it again. That drifts: the model's tokens are not always
what a fresh tokenization of their text gives (a merge the sampler did not
take, a tool call the parser re-serialized), and the trainer would then score
tokens the engine never sampled, with behaviour log-probs that belong to
other tokens.

:class:`Conversation` never retokenizes what the model generated. It keeps
the episode's ids as they came: the prompt (the first render), then for each
turn the model's sampled ids (mask 1) and, before the next turn, only the
tokens the environment adds (mask 0). Those are found as a difference of two
renders of the template, in text:

- ``before``: the conversation up to and including the model's last message,
  with no generation prompt;
- ``after``: the whole conversation the environment hands back (its answer
  appended), with the generation prompt.

``after`` must start with ``before`` (a template that rewrites earlier turns
when a new one comes cannot be used token-in, token-out: refused in one
line). The environment's text is then ``after[len(before):]``, preceded by
what the template puts after the model's end-of-turn token (``"\\n"`` for
ChatML), and by the end-of-turn token itself when the model's turn was cut
off before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from phalanx.protocol.episode import EpisodeSoFar, Turn
from phalanx.rl.engine.base import Completion, EngineError
from phalanx.rl.tokenizer import HFTokenizer


class TemplateError(EngineError):
    """The chat template cannot keep an episode's tokens as the engine made them."""


@dataclass
class ChatTemplate:
    """An HF tokenizer's chat template, rendered to text and encoded without specials
    added (the template writes them itself)."""

    tok: HFTokenizer

    def __post_init__(self) -> None:
        self.eos_text = self.tok.tok.convert_ids_to_tokens(self.tok.eos_id)

    def render(self, messages: Sequence[Any], tools: Any, generation: bool) -> str:
        kwargs = {"tools": tools} if tools else {}
        return str(
            self.tok.tok.apply_chat_template(
                list(messages), tokenize=False, add_generation_prompt=generation, **kwargs
            )
        )

    def encode(self, text: str) -> list[int]:
        return list(self.tok.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """The model's text of ``ids``, EOS left out, other special tokens kept."""
        ids = [int(i) for i in ids if int(i) != self.tok.eos_id]
        return str(self.tok.tok.decode(ids, skip_special_tokens=False))


@dataclass
class Conversation:
    """The ids of one episode so far, with the per-token mask, log-probs and versions."""

    template: ChatTemplate
    prompt_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    """The completed turns, as reported to the controller (:mod:`phalanx.protocol.episode`)."""
    last_finished: bool = True
    """Whether the model's last turn ended with its end-of-turn token (EOS)."""
    seen: int = 0
    """Messages of the conversation already in the ids (through the model's last turn)."""

    def next_prompt(self, messages: Sequence[Any], tools: Any) -> tuple[list[int], list[int]]:
        """The ids to generate the next turn from, for the environment's ``messages``,
        and the environment's ids among them (empty on the first turn)."""
        after = self.template.render(messages, tools, generation=True)
        if not self.turns:
            self.prompt_ids = self.template.encode(after)
            return list(self.prompt_ids), []
        before = self.template.render(messages[: self.seen], tools, generation=False)
        if not after.startswith(before):
            raise TemplateError(
                "the chat template renders an earlier turn differently once a new one is "
                "added, so the episode's tokens cannot be kept as the engine sampled them: "
                "use a template whose renders only append (ChatML, Qwen, Llama 3 do)"
            )
        eos = self.template.eos_text
        cut = before.rfind(eos)
        tail = before[cut + len(eos) :] if cut >= 0 else ""
        env_text = ("" if self.last_finished else eos) + tail + after[len(before) :]
        env_ids = self.template.encode(env_text)
        return self.ids() + env_ids, env_ids

    def ids(self) -> list[int]:
        return self.prompt_ids + self.token_ids

    def add_env(self, env_ids: Sequence[int]) -> None:
        """The environment's tokens before a turn: context, not trained on. Their
        version is the one of the token before them (versions never go back)."""
        v = self.versions[-1] if self.versions else 0
        self.token_ids += env_ids
        self.mask += [0] * len(env_ids)
        self.logprobs += [0.0] * len(env_ids)
        self.versions += [v] * len(env_ids)

    def add_turn(self, env_ids: Sequence[int], c: Completion, messages_seen: int) -> Turn:
        """A completed turn: the environment's ids before it, then the model's."""
        self.add_env(env_ids)
        versions = c.token_versions()
        lps = [min(lp, 0.0) for lp in c.logprobs]
        self.token_ids += c.token_ids
        self.mask += [1] * len(c.token_ids)
        self.logprobs += lps
        self.versions += versions
        self.last_finished = c.finished
        self.seen = messages_seen
        turn = Turn(
            env_ids=list(env_ids),
            token_ids=list(c.token_ids),
            logprobs=lps,
            versions=versions,
            finished=c.finished,
        )
        self.turns.append(turn)
        return turn

    def so_far(self, sample: int) -> EpisodeSoFar:
        return EpisodeSoFar(sample=sample, prompt_ids=list(self.prompt_ids), turns=self.turns)

    def version(self) -> int:
        """The oldest version of the model's tokens (0 before any turn)."""
        return min((v for v, m in zip(self.versions, self.mask, strict=True) if m), default=0)

    def completion(self, prompt_index: int, reward: float | None) -> Completion:
        """The whole episode as one completion (the trainer's row): the prompt, then
        every turn's ids after it, the environment's masked out. ``finished``: the
        model's last turn ended with EOS. ``version``: the oldest token's."""
        return Completion(
            prompt_index=prompt_index,
            prompt_ids=list(self.prompt_ids),
            token_ids=list(self.token_ids),
            logprobs=list(self.logprobs),
            finished=self.last_finished,
            version=self.version(),
            reward=reward,
            versions=list(self.versions),
            mask=list(self.mask),
        )

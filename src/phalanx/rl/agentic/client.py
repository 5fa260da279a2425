"""The replica's own engine behind the OpenAI chat interface environments expect.

A ``verifiers`` environment calls ``client.chat.completions.create(model=...,
messages=..., tools=..., **sampling)`` for every model turn. Here that call
never leaves the process: :class:`EpisodeClient` (one per episode) turns the
messages into token ids (:class:`~phalanx.rl.agentic.conversation.Conversation`:
the episode's ids so far, plus the environment's new ones), hands them to the
:class:`Batcher`, and answers with an ``openai`` ``ChatCompletion`` built from
the sampled ids (content and Hermes tool calls: :mod:`.toolcalls`).

The batcher gathers the turns of every episode the replica is running into one
``engine.generate`` call: it generates when each running episode is waiting on
the model (the others are done, or in their environment's code), so a lease's
episodes share batches as single-turn prompts do. Before each batch it calls
the replica's ``between`` hook, and the engine calls it again between decode
steps where it can (:attr:`~phalanx.rl.engine.base.GenerationEngine.inflight_updates`):
a weight update lands between two turns or inside one, never aborting a turn,
and each token records the version it was drawn from.

A prompt dispatched again after its replica was lost comes with the turns that
replica reported (``PromptRef.resume``). They are replayed: the environment runs
again (its tools too), but the model's side of each recorded turn is answered
from the record, its exact ids, log-probs and versions, and the engine only
generates from the first turn not recorded. A replayed turn's environment ids
must equal the recorded ones; if they differ (the environment is not
deterministic), the rest of the record is dropped and generation takes over.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from phalanx.protocol.episode import Turn
from phalanx.rl.agentic.conversation import Conversation
from phalanx.rl.agentic.toolcalls import parse_tool_calls
from phalanx.rl.engine.base import Completion, GenerationEngine, call_between

log = logging.getLogger("phalanx.rl.agentic")


@dataclass
class _Request:
    ids: list[int]
    key: int
    max_tokens: int
    done: asyncio.Future[Completion]


@dataclass
class Batcher:
    """One ``engine.generate`` per round of turns of the running episodes."""

    engine: GenerationEngine
    temperature: float
    between: Callable[[], None] | None = None
    pending: list[_Request] = field(default_factory=list)
    active: int = 0
    """Episodes running: a batch goes out when every one of them is waiting on it."""
    batches: int = 0
    turns: int = 0
    gen_s: float = 0.0

    def start(self) -> None:
        self.active += 1

    def finish(self) -> None:
        self.active -= 1
        self._ready()

    async def generate(self, ids: list[int], key: int, max_tokens: int) -> Completion:
        done: asyncio.Future[Completion] = asyncio.get_running_loop().create_future()
        self.pending.append(_Request(ids, key, max_tokens, done))
        self._ready()
        return await done

    def _ready(self) -> None:
        if self.pending and len(self.pending) >= self.active:
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        reqs, self.pending = self.pending, []
        if not reqs:
            return
        try:
            if self.between is not None:
                # Between two turns: a sync ordered meanwhile lands here.
                call_between(self.engine, self.between)
            t0 = time.perf_counter()
            out: dict[int, Completion] = {}
            # One call per turn length (a turn near the episode's budget asks fewer).
            for n in sorted({r.max_tokens for r in reqs}):
                group = [i for i, r in enumerate(reqs) if r.max_tokens == n]
                hook = {"between": self.between} if self.between is not None else {}
                comps = self.engine.generate(
                    [reqs[i].ids for i in group],
                    1,
                    n,
                    self.temperature,
                    keys=[reqs[i].key for i in group],
                    **hook,
                )
                out.update(zip(group, comps, strict=True))
            self.gen_s += time.perf_counter() - t0
            self.batches += 1
            self.turns += len(reqs)
        except BaseException as e:
            for r in reqs:
                if not r.done.done():
                    r.done.set_exception(e)
            return
        for i, r in enumerate(reqs):
            if not r.done.done():
                r.done.set_result(out[i])


def turn_key(key: int, sample: int, turn: int) -> int:
    """The sampling key of turn ``turn`` of sample ``sample`` of a prompt keyed ``key``:
    a turn's tokens depend on the prompt, the sample, the turn and the weights only."""
    return (key * 0x94D049BB133111EB + (sample << 20) + turn + 1) & (2**63 - 1)


class OverBudget(Exception):
    """The episode's next turn would pass ``rl.env.max_episode_tokens``."""


@dataclass
class EpisodeClient:
    """An ``AsyncOpenAI`` look-alike for one episode: ``chat.completions.create``."""

    batcher: Batcher
    conv: Conversation
    key: int
    sample: int
    turn_tokens: int
    budget: int
    replay: list[Turn] = field(default_factory=list)
    replay_prompt: list[int] | None = None
    """The recorded episode's prompt ids: a replay whose first render differs is dropped."""
    on_turn: Callable[[EpisodeClient], None] | None = None
    replayed: int = 0
    """Turns answered from the record of a lost replica."""
    overlong: type[Exception] = OverBudget

    def __post_init__(self) -> None:
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))
        self.call_prefix = f"call-{uuid.uuid4().hex[:8]}"

    async def create(
        self, model: str = "", messages: Any = (), tools: Any = None, **sampling: Any
    ) -> Any:
        messages = list(messages)
        prompt, env_ids = self.conv.next_prompt(messages, tools)
        left = self.budget - len(self.conv.token_ids) - len(env_ids)
        if left <= 0:
            raise self.overlong(
                f"episode over rl.env.max_episode_tokens = {self.budget}: the environment's "
                f"answer leaves no room for another turn"
            )
        c = self._replayed(env_ids)
        if c is None:
            turn = len(self.conv.turns)
            c = await self.batcher.generate(
                prompt, turn_key(self.key, self.sample, turn), min(self.turn_tokens, left)
            )
            fresh = True
        else:
            fresh = False
        self.conv.add_turn(env_ids, c, messages_seen=len(messages) + 1)
        if fresh and self.on_turn is not None:
            self.on_turn(self)
        return self._response(c, bool(tools))

    def _replayed(self, env_ids: list[int]) -> Completion | None:
        if not self.replay:
            return None
        t = self.replay.pop(0)
        first = not self.conv.turns and self.replay_prompt is not None
        if list(t.env_ids) != list(env_ids) or (
            first and self.replay_prompt != self.conv.prompt_ids
        ):
            log.warning(
                "episode replay diverged at turn %d (the environment answered differently): "
                "generating from there",
                len(self.conv.turns),
            )
            self.replay = []
            return None
        self.replayed += 1
        v = t.versions[0] if t.versions else 0
        return Completion(
            0, [], list(t.token_ids), list(t.logprobs), t.finished, v, versions=list(t.versions)
        )

    def _response(self, c: Completion, tools: bool) -> Any:
        from openai.types.chat import ChatCompletion, ChatCompletionMessage
        from openai.types.chat.chat_completion import Choice

        text = self.conv.template.decode(c.token_ids)
        parsed = parse_tool_calls(text, f"{self.call_prefix}-{len(self.conv.turns)}")
        calls = [
            {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
            for t in parsed.calls
        ]
        message = ChatCompletionMessage.model_validate(
            {
                "role": "assistant",
                "content": parsed.content if tools else text,
                "tool_calls": (calls or None) if tools else None,
            }
        )
        reason = "length" if not c.finished else ("tool_calls" if calls and tools else "stop")
        return ChatCompletion(
            id=f"{self.call_prefix}-{len(self.conv.turns)}",
            choices=[Choice(index=0, finish_reason=reason, message=message)],
            created=int(time.time()),
            model="phalanx",
            object="chat.completion",
        )

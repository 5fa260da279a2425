"""A lease's prompts run as multi-turn episodes against a ``verifiers`` environment.

Each leased prompt is a row of the environment's dataset (prompt ``i`` is row
``i`` mod its length); each of its ``group_size`` samples runs as one episode
(``env.rollout`` with an in-process client: :mod:`.client`), and the group is
scored by the environment's rubric (``rubric.score_group``), as ``verifiers``'
own ``run_group`` does. Each episode becomes one completion for the trainer:
the prompt, then every turn's ids, the environment's masked out
(:mod:`.conversation`).

After each turn an episode completes, its prompt's episodes so far are
reported to the controller (``rl.env.report_turns``), so a replica lost
mid-episode costs at most the turns in flight: the prompt is dispatched again
with the report (``PromptRef.resume``), and the next replica replays it.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from phalanx.config.rl import RLConfig
from phalanx.protocol.episode import EpisodeProgress, Turn
from phalanx.protocol.rl import Completion, PromptRef, RolloutIn
from phalanx.rl.agentic.client import Batcher, EpisodeClient
from phalanx.rl.agentic.conversation import ChatTemplate, Conversation
from phalanx.rl.agentic.envs import LoadedEnv
from phalanx.rl.engine.base import GenerationEngine, prompt_key
from phalanx.rl.tokenizer import HFTokenizer

log = logging.getLogger("phalanx.rl.agentic")

Report = Callable[[list[EpisodeProgress]], None]
"""Sends a prompt's episodes so far to the controller (``report_episodes``)."""
TurnDone = Callable[[str, int, Turn], None]
"""Told of each turn generated here: (rollout id, sample, the turn)."""


@dataclass
class LeaseStats:
    """What one lease's episodes did (the rollout event's fields)."""

    turns: int = 0
    """Model turns generated here."""
    replayed: int = 0
    """Turns answered from a lost replica's report instead of generated again."""
    resumed: int = 0
    """Episodes that came with a report."""
    batches: int = 0
    reports: int = 0
    episode_tokens: list[int] = field(default_factory=list)


@dataclass
class Episodes:
    """Runs leases as episodes of ``env`` on ``engine``."""

    rl: RLConfig
    engine: GenerationEngine
    tok: HFTokenizer
    env: LoadedEnv

    def __post_init__(self) -> None:
        self.template = ChatTemplate(self.tok)
        self.report: Report | None = None
        self.turn_done: TurnDone | None = None

    def rollouts(
        self,
        prompts: list[PromptRef],
        between: Callable[[], None] | None = None,
        report: Report | None = None,
        turn_done: TurnDone | None = None,
    ) -> tuple[list[RolloutIn], LeaseStats]:
        """One rollout per leased prompt, each of ``group_size`` episodes; ``report``
        gets each prompt's episodes after each turn generated here, and ``turn_done``
        that turn. An EngineError (a weight update in flight failed part-way)
        propagates: the lease is abandoned, as single-turn generation abandons it."""
        self.report, self.turn_done = report, turn_done
        return asyncio.run(self._lease(prompts, between))

    async def _lease(
        self, prompts: list[PromptRef], between: Callable[[], None] | None
    ) -> tuple[list[RolloutIn], LeaseStats]:
        g, stats = self.rl.grpo, LeaseStats()
        batcher = Batcher(self.engine, g.temperature, between)
        groups: list[list[EpisodeClient]] = []
        for p in prompts:
            resume = {e.sample: e for e in (p.resume.episodes if p.resume else [])}
            on_turn = self._reporter(p, stats)
            clients = []
            for j in range(g.group_size):
                rec = resume.get(j)
                c = EpisodeClient(
                    batcher,
                    Conversation(self.template),
                    prompt_key(g.seed, p.index),
                    j,
                    g.max_new_tokens,
                    self.env.budget,
                    replay=list(rec.turns) if rec is not None else [],
                    replay_prompt=list(rec.prompt_ids) if rec is not None else None,
                    on_turn=on_turn,
                    overlong=self.env.overlong,
                )
                stats.resumed += rec is not None
                clients.append(c)
                batcher.start()  # all before any turn: the first batch waits for them all
            groups.append(clients)
        states = await asyncio.gather(
            *(
                self._episode(batcher, self.env.row(p.index), c)
                for p, clients in zip(prompts, groups, strict=True)
                for c in clients
            )
        )
        stats.turns, stats.batches = batcher.turns, batcher.batches
        out = []
        for i, (p, clients) in enumerate(zip(prompts, groups, strict=True)):
            group = states[i * g.group_size : (i + 1) * g.group_size]
            stats.replayed += sum(c.replayed for c in clients)
            stats.episode_tokens += [len(c.conv.token_ids) for c in clients]
            out.append(await self._scored(p, clients, group))
        return out, stats

    async def _episode(self, batcher: Batcher, row: dict[str, Any], c: EpisodeClient) -> Any:
        try:
            return await self.env.env.rollout(copy.deepcopy(row), c, "phalanx", {})
        finally:
            batcher.finish()

    def _reporter(self, p: PromptRef, stats: LeaseStats) -> Callable[[EpisodeClient], None]:
        """After an episode's turn: the prompt's episodes so far, to the controller."""
        clients: list[EpisodeClient] = []

        def on_turn(c: EpisodeClient) -> None:
            if c not in clients:
                clients.append(c)
            if self.report is not None:
                eps = [x.conv.so_far(x.sample) for x in sorted(clients, key=lambda x: x.sample)]
                self.report([EpisodeProgress(rollout_id=p.rollout_id, episodes=eps)])
                stats.reports += 1
            if self.turn_done is not None:
                self.turn_done(p.rollout_id, c.sample, c.conv.turns[-1])

        return on_turn

    async def _scored(
        self, p: PromptRef, clients: list[EpisodeClient], states: list[Any]
    ) -> RolloutIn:
        """The group scored by the rubric, as one rollout; discarded (with the reason)
        when an episode made no turn or the rubric failed."""
        empty = [s for s, c in zip(states, clients, strict=True) if not c.conv.turns]
        if empty:
            why = f"an episode of prompt {p.index} made no turn: {one_error(empty[0])}"
            return self._discard(p, clients, why)
        try:
            await self.env.env.rubric.score_group(states)
            rewards = [float(s["reward"] or 0.0) for s in states]
        except Exception as e:
            return self._discard(p, clients, f"the rubric failed: {type(e).__name__}: {e}")
        rows = []
        for c, r in zip(clients, rewards, strict=True):
            ep = c.conv.completion(p.index, r)
            rows.append(
                Completion(
                    prompt_ids=ep.prompt_ids,
                    token_ids=ep.token_ids,
                    logprobs=ep.logprobs,
                    finished=ep.finished,
                    reward=r,
                    versions=ep.versions,
                    mask=ep.mask,
                )
            )
        return RolloutIn(
            rollout_id=p.rollout_id,
            version=min(c.conv.version() for c in clients),
            reward=sum(rewards) / len(rewards),
            exact_match=sum(r >= 1.0 for r in rewards) / len(rewards),
            completions=rows,
        )

    def _discard(self, p: PromptRef, clients: list[EpisodeClient], why: str) -> RolloutIn:
        log.warning("prompt %d: %s; its rollout is discarded", p.index, why[:300])
        versions = [c.conv.version() for c in clients if c.conv.turns]
        return RolloutIn(
            rollout_id=p.rollout_id,
            version=min(versions, default=self.engine.version if self.engine.version >= 0 else 0),
            reward=0.0,
            exact_match=0.0,
            discard=why[:300],
        )


def one_error(state: Any) -> str:
    err = state.get("error") if hasattr(state, "get") else None
    return " ".join(f"{type(err).__name__}: {err}".split())[:200] if err else "no model call"

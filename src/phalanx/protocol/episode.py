"""Episodes in progress: the completed turns of a multi-turn rollout, reported to the
controller so that an episode outlives the rollout replica that ran it.

A multi-turn environment (``[rl.env]``: :mod:`phalanx.rl.agentic`) runs each
sample of a leased prompt as an episode of turns: the model generates, the
environment answers (a tool's result, an observation), the model generates
again. After each completed turn the replica reports the episode so far
(:class:`EpisodeProgress`, ``POST /v1/rl/episodes``) against its lease. When
the replica dies, the controller dispatches the prompt again as it always
did, and the new lease's :class:`~phalanx.protocol.rl.PromptRef` carries the
last progress reported (``resume``): the replica that takes it replays the
recorded turns (their exact tokens, log-probs and versions, never generated
again) through the environment and generates only from there. At most the
turn in flight is lost, and the ledger accounts for the prompt's rollout once,
as for any prompt.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Annotated

from pydantic import Field, model_validator

from phalanx.protocol.base import Count, ReplicaId, Reply, Wire
from phalanx.protocol.tokens import MAX_GROUP, LeaseId, LogProbs, RolloutId, TokenIds

MAX_TURNS = 1024
"""Most turns of one episode."""
MAX_ENV_STATE = 1 << 20
"""Longest serialized environment state (JSON text) one episode may report."""


class Turn(Wire):
    """One completed turn: what the environment added before it, and what the model
    generated (exact token ids, behaviour log-probs and versions, as the engine made
    them)."""

    env_ids: TokenIds = []
    """The environment's tokens before this turn's generation (its answer to the last
    turn and the chat template's turn markers); empty on the first turn."""
    token_ids: TokenIds
    logprobs: LogProbs
    versions: Annotated[list[Count], Field(max_length=1 << 16)]
    """The behaviour version of each of ``token_ids`` (non-decreasing)."""
    finished: bool
    """The turn ended with EOS (False: cut off at the turn's token limit)."""

    @model_validator(mode="after")
    def _lengths(self) -> Turn:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"a turn needs one log-prob and one version per token: got {n} tokens, "
                f"{len(self.logprobs)} log-probs, {len(self.versions)} versions"
            )
        if any(b < a for a, b in pairwise(self.versions)):
            raise ValueError(
                f"a turn's versions must be non-decreasing (weights only move forward during "
                f"a generation): got {self.versions[:16]}"
            )
        return self


class EpisodeSoFar(Wire):
    """The completed turns of one sample of a prompt's group."""

    sample: int = Field(ge=0, lt=MAX_GROUP)
    prompt_ids: TokenIds
    turns: Annotated[list[Turn], Field(max_length=MAX_TURNS)]
    env_state: str = Field("", max_length=MAX_ENV_STATE)
    """The environment's own state after the last turn, as JSON, where it serializes
    it (empty: the environment is rebuilt by replaying the turns)."""


class EpisodeProgress(Wire):
    """The episodes of one leased prompt so far: one per sample that completed a turn."""

    rollout_id: RolloutId
    episodes: Annotated[list[EpisodeSoFar], Field(max_length=MAX_GROUP)]


class EpisodeProgressReq(Wire):
    replica_id: ReplicaId
    lease_id: LeaseId
    progress: Annotated[list[EpisodeProgress], Field(min_length=1, max_length=MAX_GROUP)]


class EpisodeProgressReply(Reply):
    """Which reports the controller kept (their prompts are in the caller's live lease)
    and which it refused (the lease expired, or the prompt is not in it: the episode is
    someone else's now, and the caller should stop running it)."""

    kept: Annotated[list[RolloutId], Field(max_length=MAX_GROUP)]
    unleased: Annotated[list[RolloutId], Field(max_length=MAX_GROUP)] = []
    over_cap: Annotated[list[RolloutId], Field(max_length=MAX_GROUP)] = []
    """Not kept, though leased: the controller holds ``rl.loop.episode_bytes`` of
    progress already. The episode goes on; a replica that takes it over resumes from
    the last report kept for it (or from the prompt)."""

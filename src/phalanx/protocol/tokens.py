"""Token-level field types shared by rollouts (:mod:`phalanx.protocol.rl`) and the
episodes in progress of multi-turn environments (:mod:`phalanx.protocol.episode`)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

MAX_GROUP = 4096
"""Most completions in one rollout, and most rollouts or prompts in one message."""
MAX_TOKENS = 1 << 16
"""Most tokens in one prompt or completion (a multi-turn episode's tokens after its
prompt count as one completion)."""

RolloutId = Annotated[str, Field(min_length=3, max_length=40, pattern=r"^p[0-9]+\.[0-9]+$")]
"""``p<prompt>.<attempt>``: the attempt grows only when a rollout of the prompt is
discarded and the prompt dispatched again."""
LeaseId = Annotated[str, Field(min_length=1, max_length=40)]
PayloadRef = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")]
"""Where a rollout store put a payload (unique per put: never reused)."""
TokenIds = Annotated[list[Annotated[int, Field(ge=0, le=2**31)]], Field(max_length=MAX_TOKENS)]
LogProbs = Annotated[list[Annotated[float, Field(le=0)]], Field(max_length=MAX_TOKENS)]
TokenMask = Annotated[list[Annotated[int, Field(ge=0, le=1)]], Field(max_length=MAX_TOKENS)]
"""One 0/1 per token: 1 for the model's tokens (trained on), 0 for an environment's."""

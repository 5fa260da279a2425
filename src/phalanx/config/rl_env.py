"""The ``[rl.env]`` section: a multi-turn environment run inside each rollout replica.

A job with ``[rl.env]`` runs every sample of a leased prompt as an episode against a
``verifiers`` environment (``MultiTurnEnv``, ``ToolEnv`` and their rubrics: see
:mod:`phalanx.rl.agentic`) instead of scoring one completion with ``[rl.task]``'s
reward; the environment's dataset gives the prompts and its rubric the rewards.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from phalanx.protocol.tokens import MAX_TOKENS


class EnvSection(BaseModel):
    """Which environment, built how, and the limits of its episodes and tools."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    module: str = Field(min_length=1, max_length=300, pattern=r"^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$")
    """The environment's module, as ``package.module`` (its ``load_environment``, the
    ``verifiers`` convention) or ``package.module:function``; importable from the job's
    Python path (a module beside the job file is found too)."""
    args: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of ``load_environment`` (a TOML table)."""
    max_episode_tokens: int = Field(2048, ge=1, le=MAX_TOKENS)
    """Most tokens of one episode after its prompt (the model's and the environment's):
    a turn that would pass it ends the episode as truncated. Each turn generates at
    most ``rl.grpo.max_new_tokens``."""
    sandbox_time_s: float = Field(5.0, gt=0, le=3600)
    """Wall-clock limit of one sandboxed tool call (:mod:`phalanx.rl.sandbox`)."""
    sandbox_memory_mb: int = Field(256, ge=64, le=1 << 20)
    """Address-space limit of one sandboxed tool call, in MiB."""
    report_turns: bool = True
    """Report each episode's completed turns to the controller, so that a replica lost
    mid-episode costs at most the turn in flight (another replica replays the
    reported turns). False: a lost replica's episodes start again from the prompt."""


def env_args(section: EnvSection) -> dict[str, Any]:
    """``load_environment``'s keyword arguments (a copy: the environment may keep them)."""
    return dict(section.args)

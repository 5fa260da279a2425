"""The rollout replica's side of ``[rl.env]``: a lease's episodes, reported as they go.

:func:`episodes_of` builds the environment once per replica (a module that
does not load is a one-line JobError at start, before any lease);
:meth:`ReplicaEpisodes.lease` runs one lease's prompts as episodes
(:mod:`.runner`), reporting each prompt's completed turns to the controller
(``report_episodes``) so that they outlive this replica, and returns the
rollouts with the fields of the replica's ``rollout`` event.

A report that fails (the controller is restarting, the network blips) is
logged and skipped: the next turn's report carries everything again, and the
worst a lost report costs is replaying or regenerating those turns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from phalanx.comm.base import CommError
from phalanx.config.rl import RLConfig
from phalanx.jobs.common import emit
from phalanx.protocol.episode import EpisodeProgress, Turn
from phalanx.protocol.rl import PromptLease, RolloutIn
from phalanx.rl.agentic.runner import Episodes
from phalanx.rl.base import Tokenizer
from phalanx.rl.engine.base import GenerationEngine
from phalanx.rl.tokenizer import HFTokenizer

log = logging.getLogger("phalanx.rl.agentic")


@dataclass
class ReplicaEpisodes:
    episodes: Episodes
    report_turns: bool

    def lease(
        self, client: Any, lease: PromptLease, between: Callable[[], None] | None
    ) -> tuple[list[RolloutIn], dict[str, Any]]:
        """The lease's rollouts, and the rollout event's episode fields."""

        refused: set[str] = set()  # prompts the lease no longer holds: not reported again

        def report(progress: list[EpisodeProgress]) -> None:
            progress = [p for p in progress if p.rollout_id not in refused]
            if not progress:
                return
            try:
                reply = client.report_episodes(lease.lease_id, progress)
            except (CommError, OSError, ValueError) as e:
                log.warning("episode report for lease %s failed: %s", lease.lease_id, e)
                return
            if reply.unleased:
                refused.update(reply.unleased)
                log.info(
                    "lease %s no longer holds %s (it expired, or the job finished): their "
                    "episodes go on here, unreported",
                    lease.lease_id,
                    ", ".join(reply.unleased[:4]),
                )

        def turn_done(rollout_id: str, sample: int, turn: Turn) -> None:
            # The audit trail of every turn generated (bench/agentic.py counts the turns
            # a killed replica made that nobody used).
            emit(
                {
                    "event": "turn",
                    "role": "rollout",
                    "replica": client.replica_id,
                    "rollout": rollout_id,
                    "sample": sample,
                    "tokens": len(turn.token_ids),
                    "versions": sorted(set(turn.versions)),
                    "t": time.time(),
                }
            )

        rollouts, st = self.episodes.rollouts(
            lease.prompts, between, report if self.report_turns else None, turn_done
        )
        n = len(st.episode_tokens)
        return rollouts, {
            "turns": st.turns,
            "replayed_turns": st.replayed,
            "resumed_episodes": st.resumed,
            "episode_reports": st.reports,
            "episode_tokens": round(sum(st.episode_tokens) / n, 1) if n else 0,
        }


def episodes_of(rl: RLConfig, engine: GenerationEngine, tok: Tokenizer) -> ReplicaEpisodes | None:
    """The replica's episodes when the job has ``[rl.env]``, else None. ValueError (one
    line) when the environment does not load."""
    if rl.env is None:
        return None
    from phalanx.rl.agentic.envs import load_env

    if not isinstance(tok, HFTokenizer):  # the config refuses it first; kept for callers
        raise ValueError("rl.env needs rl.task.tokenizer_path (a tokenizer with a chat template)")
    return ReplicaEpisodes(Episodes(rl, engine, tok, load_env(rl.env)), rl.env.report_turns)

"""The tracker interface, and the metrics of one trained RL batch as a flat dict.

A job has one writer of its metrics (:mod:`phalanx.track.job`): the launcher,
one agent, or the Ray driver. For RL it reads the trained batches from the
controller's status (the ledger's history), so that with any number of policy
replicas each batch is logged once, and a replica that dies or heals changes
nothing. A tracker that fails is dropped with a warning: tracking must never
stop training.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping

from phalanx.protocol.status import BatchRecord

log = logging.getLogger("phalanx.track")


class Tracker(ABC):
    """A sink of scalar metrics, keyed by a step that only grows."""

    @abstractmethod
    def log(self, step: int, metrics: Mapping[str, float], wall: float | None = None) -> None:
        """Record ``metrics`` at ``step`` (the batch index); ``wall``: when the step
        happened (``time.time()``; None: now)."""

    @abstractmethod
    def close(self) -> None:
        """Flush and release; called once, at the end of the job."""


def batch_metrics(rec: BatchRecord, discarded: Mapping[str, int] | None = None) -> dict[str, float]:
    """One trained batch as flat ``group/name`` scalars; ``discarded`` (the ledger's
    discard counts by reason, cumulative) is logged alongside."""
    out: dict[str, float] = {
        "rl/reward": rec.reward,
        "rl/exact_match": rec.exact_match,
        "rl/reward_avg": rec.reward_avg,
        "rl/exact_match_avg": rec.exact_match_avg,
        "rl/staleness": float(rec.staleness),
        "rl/policy_step": float(rec.step),
    }
    if rec.tokens_per_s is not None:
        out["perf/tokens_per_s"] = rec.tokens_per_s
    m = rec.metrics
    if m is not None:
        for key, group in (
            ("tokens", "rl"),
            ("train_tokens_per_s", "perf"),
            ("mfu", "perf"),
            ("peak_mem_mb", "perf"),
            ("entropy", "policy"),
            ("kl_behaviour", "policy"),
            ("kl_ref", "policy"),
            ("clip_frac", "policy"),
            ("mismatch_kl", "offpolicy"),
            ("ess", "offpolicy"),
            ("is_clip_frac", "offpolicy"),
            ("is_mask_frac", "offpolicy"),
            ("idle", "perf"),
        ):
            v = getattr(m, key)
            if v is not None:
                out[f"{group}/{key}"] = float(v)
        # One scalar per staleness seen: the tokens trained that many versions late.
        for s, n in (m.staleness_tokens or {}).items():
            out[f"staleness_tokens/{s}"] = float(n)
    for reason, n in (discarded or {}).items():
        out[f"discarded/{reason}"] = float(n)
    return out


class Trackers(Tracker):
    """Every configured tracker; one that raises is dropped (the others go on)."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers
        self.last_step = -1

    def log(self, step: int, metrics: Mapping[str, float], wall: float | None = None) -> None:
        if step <= self.last_step:
            return  # already logged (a status read twice, a restarted poll)
        self.last_step = step
        for t in list(self.trackers):
            try:
                t.log(step, metrics, wall)
            except Exception as e:  # a tracker is best-effort: never fail the job
                log.warning("tracker %s failed and is dropped: %s", type(t).__name__, e)
                self.trackers.remove(t)

    def close(self) -> None:
        for t in self.trackers:
            try:
                t.close()
            except Exception as e:  # the job is over; report and go on
                log.warning("tracker %s did not close cleanly: %s", type(t).__name__, e)
        self.trackers = []

"""The GRPO step of one policy replica, over the FT manager's quorum.

A replica gets its step's frozen batch from the ledger (every member of the
quorum gets the same one), with each rollout's payload (the completions) or
the ref to read it by from the rollout store. :func:`check_payload` refuses a
payload that does not fit the job or the ledger's summary of it, and
:class:`PolicyTrainer` computes the loss on this replica's share of the
batch's trainable rows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from phalanx.config.rl import RLConfig
from phalanx.protocol.rl import MAX_GROUP, BatchMetrics
from phalanx.rl.corrections import staleness_histogram
from phalanx.rl.engine.base import Completion
from phalanx.rl.grpo import group_advantages, rows_to_train
from phalanx.rl.model import num_params
from phalanx.rl.step import (
    Proximal,
    backward_rows,
    merge_stats,
    mfu,
    peak_memory_mb,
    peak_tflops,
)
from phalanx.train.batch import split

if TYPE_CHECKING:
    from phalanx.protocol.rl import BatchRollout, RolloutPayload
    from phalanx.train.manager import Manager

Rows = list[tuple[int, "RolloutPayload"]]
"""(prompt index, payload) of each rollout of a batch."""


def check_payload(
    payload: RolloutPayload, summary: BatchRollout, group_size: int, max_tokens: int
) -> str | None:
    """Why ``payload`` cannot be trained as the ledger's ``summary`` describes it, or
    None. A store that lost or mixed up payloads must not train the wrong ones."""
    if payload.rollout_id != summary.rollout_id or payload.version != summary.version:
        return (
            f"holds {payload.rollout_id} v{payload.version}, the ledger "
            f"{summary.rollout_id} v{summary.version}"
        )
    if len(payload.completions) != group_size:
        return f"has {len(payload.completions)} completions, group_size is {group_size}"
    for c in payload.completions:
        if not c.token_ids or len(c.token_ids) != len(c.logprobs):
            return "has a completion without one log-prob per token"
        if len(c.token_ids) > max_tokens:
            return f"has a completion of {len(c.token_ids)} tokens > its limit {max_tokens}"
        if c.versions and c.versions[0] < payload.version:
            return f"has a token of version {c.versions[0]} older than its v{payload.version}"
    return None


def completions_of(rows: Rows) -> tuple[list[Completion], list[float]]:
    """The batch's completions, prompt-major in prompt order, and their rewards.

    The ledger lists a batch's rollouts in arrival order, which depends on
    timing; prompt order makes the loss's sums (and so the trained weights) the
    same whichever replica submitted first or how often a prompt was dispatched."""
    comps, rewards = [], []
    for _, p in sorted(rows, key=lambda row: row[0]):
        for c in p.completions:
            comps.append(
                Completion(
                    0,
                    list(c.prompt_ids),
                    list(c.token_ids),
                    list(c.logprobs),
                    c.finished,
                    p.version,
                    versions=list(c.versions),
                    mask=list(c.mask),
                )
            )
            rewards.append(float(c.reward))
    return comps, rewards


def staleness_of(rows: Rows, step: int) -> dict[int, int]:
    """Completion tokens of the batch ``rows`` per staleness, trained from weights
    version ``step`` (:func:`phalanx.rl.corrections.staleness_histogram`)."""
    return staleness_histogram(((p.version, c) for _, p in rows for c in p.completions), step)


def _counted(stats: dict[str, float], manager: Manager) -> dict[str, float]:
    """``stats`` as this rank adds them into its replica's sums: the ranks of one TP
    group computed the same rows, so only the group's first counts their loss and
    tokens (as :meth:`~phalanx.train.hsdp.HSDPManager._run` does); the others' are 0."""
    ranks = getattr(manager, "ranks", None)
    tp = getattr(ranks, "tp", 1)
    if ranks is None or tp == 1 or ranks.rank % tp == 0:
        return stats
    return {**stats, "loss": 0.0, "train_tokens": 0.0}


class PolicyTrainer:
    """The GRPO step of one policy replica over the manager's quorum."""

    def __init__(
        self,
        rl: RLConfig,
        manager: Manager,
        model: Any,
        pad_id: int,
        ref: Any = None,
        exact_parts: int = 1,
    ):
        """``exact_parts``: with an exact reduction and ``grpo.micro_batch_size`` 0,
        the units a step's rows are cut in (``n_init_replicas x ranks``)."""
        self.rl, self.g = rl, rl.grpo
        self.manager, self.model, self.pad_id, self.ref = manager, model, pad_id, ref
        self.exact_parts = exact_parts
        self.params = num_params(model)
        self.proximal = Proximal()
        """The current batch's proximal policy (an off-policy correction's pi_prox)."""
        self.peak = peak_tflops(torch.device(self.g.device), self.g.precision, rl.track.peak_tflops)

    def compute(self, rows: Rows) -> dict[str, float]:
        """Forward and backward on this replica's share of the batch's trainable rows,
        micro-batched (:func:`phalanx.rl.step.backward_rows`). Returns the share's stats;
        ``loss`` is already normalised by the batch's token count."""
        g, m = self.g, self.manager
        self.proximal.start(m.step // g.inner_epochs)
        comps, rewards = completions_of(rows)
        adv = group_advantages(torch.tensor(rewards), g.group_size, g.adv_eps)
        keep = rows_to_train(adv, g.kl_coef)
        if m.exact:
            return _counted(self._compute_units(comps, adv, keep), m)
        off, count = split(len(keep), m.world_size, m.rank)
        mine = keep[off : off + count]
        if not mine:
            return {"loss": 0.0, "train_tokens": 0.0}
        n_tokens = sum(c.trained_tokens() for c in comps)
        passes, filler = 0, None
        ranks = getattr(m, "ranks", None)
        if ranks is not None and ranks.size > 1:
            # A sharded replica: its share again over its data-parallel ranks (a TP
            # group's ranks take the same rows), every rank running as many
            # micro-batches as the rank with the most rows.
            most = -(-len(mine) // ranks.dp_size)
            per = g.micro_batch_size if g.micro_batch_size > 0 else most
            passes, filler = -(-most // per), mine[0]
            sub_off, sub_count = split(len(mine), ranks.dp_size, ranks.dp_rank)
            mine = mine[sub_off : sub_off + sub_count]
        return _counted(self._backward(comps, adv, mine, n_tokens, passes, filler), m)

    def _backward(
        self,
        comps: list[Completion],
        adv: torch.Tensor,
        rows: list[int],
        n_tokens: int,
        passes: int,
        filler: int | None,
    ) -> dict[str, float]:
        return backward_rows(
            self.model,
            comps,
            adv,
            rows,
            g=self.g,
            pad_id=self.pad_id,
            num_tokens=n_tokens,
            ref=self.ref,
            passes=passes,
            filler=filler,
            proximal=self.proximal,
        )

    def _compute_units(
        self, comps: list[Completion], adv: torch.Tensor, keep: list[int]
    ) -> dict[str, float]:
        """The exact reduction's share: fixed units of the trainable rows
        (:mod:`phalanx.train.exact_grads`), each backward into a slot of its own; a
        sharded replica's ranks split each unit, one pass each."""
        g, m = self.g, self.manager
        grads: Any = m.grads  # (an exact buffer: ExactGrads, or ExactShardedGrads)
        ranks = getattr(m, "ranks", None)
        size, rank = (ranks.dp_size, ranks.dp_rank) if ranks is not None else (1, 0)
        per = g.micro_batch_size or max(1, -(-len(keep) // self.exact_parts))
        unit = per * size
        off, count = split(-(-len(keep) // unit), m.world_size, m.rank)
        n_tokens = sum(c.trained_tokens() for c in comps)
        parts = []
        for j in range(off, off + count):
            rows = keep[j * unit : (j + 1) * unit]
            passes, filler = (1, rows[0]) if size > 1 else (0, None)
            sub_off, sub_count = split(len(rows), size, rank)
            grads.begin(j)
            stats = self._backward(
                comps, adv, rows[sub_off : sub_off + sub_count], n_tokens, passes, filler
            )
            stats = _counted(stats, m)
            grads.end(j, stats["loss"])
            parts.append(stats)
        return merge_stats(parts, with_ref=self.ref is not None)

    def metrics(
        self, rows: Rows, stats: dict[str, float], seconds: float, step: int | None = None
    ) -> BatchMetrics:
        """What this replica measured on its last step of the batch ``rows``: the
        batch's completion tokens, and its own share's throughput, MFU and stats.
        ``step``: the weights version that step trained from (the committed step count
        before its commit), for the staleness histogram of the batch's tokens (None:
        no histogram; nor one wider than the wire allows)."""
        tokens = sum(len(c.token_ids) for _, p in rows for c in p.completions)
        hist = staleness_of(rows, step) if step is not None else None
        hist = hist if hist is not None and len(hist) <= MAX_GROUP else None
        train = stats.get("train_tokens", 0.0)
        util = mfu(self.params, train, seconds, self.peak)

        def num(key: str) -> float | None:
            v = stats.get(key)
            return None if v is None or v != v else round(float(v), 6)

        return BatchMetrics(
            tokens=tokens,
            train_tokens_per_s=round(train / seconds, 1) if seconds > 0 else None,
            mfu=round(util, 5) if util is not None else None,
            entropy=num("entropy"),
            kl_behaviour=num("kl_behaviour"),
            kl_ref=num("kl_ref"),
            clip_frac=num("clip_frac"),
            mismatch_kl=num("mismatch_kl"),
            ess=num("ess"),
            is_clip_frac=num("is_clip_frac"),
            is_mask_frac=num("is_mask_frac"),
            staleness_tokens={str(k): n for k, n in hist.items()} if hist is not None else None,
            peak_mem_mb=round(peak_memory_mb(torch.device(self.g.device)), 1),
        )

"""The lineage: the batches the policy trained, durably, in the chain of steps
that leads to its current weights (DESIGN.md, vocabulary).

"Trained" in the ledger means "in the lineage". A batch joins it when a save
holding its last step commits (the ack that drops it); its rollouts' payloads
are gone then, but the lineage keeps their ids, so that the batch can still be
taken back: when every replica and every checkpoint that held a step is gone,
the job rolls back explicitly (:mod:`..quorum`), and each batch trained past
the step it went back to leaves the lineage, its prompts issued again under a
new attempt and its rollouts counted as discarded (``rolled_back``).

One record per trained batch, journaled in the ``lineage`` table (a few ids
each: the whole job's stays small).
"""

from __future__ import annotations

from typing import Any

from phalanx.controller.core.base import ChangeLog


class LineageBook:
    def __init__(self, log: ChangeLog):
        self.log = log
        self.batches: dict[int, list[str]] = {}
        """Trained batch index -> the ids of the rollouts it trained on."""
        self.replayed: dict[int, list[str]] = {}
        """Trained batch index -> the replay entries it trained on too (by original id)."""

    def restore(self, tables: dict[str, dict[str, dict[str, Any]]]) -> None:
        for rec in tables.get("lineage", {}).values():
            self.batches[int(rec["index"])] = [str(r) for r in rec["rollouts"]]
            if rec.get("replayed"):
                self.replayed[int(rec["index"])] = [str(r) for r in rec["replayed"]]

    def add(
        self, index: int, rollout_ids: list[str], step: int, replayed: list[str] | None = None
    ) -> None:
        """Batch ``index`` is trained: a committed save holds ``step``, its last step.
        ``replayed``: the replay entries it trained on besides its fresh rollouts."""
        self.batches[index] = list(rollout_ids)
        rec: dict[str, Any] = {"index": index, "rollouts": rollout_ids, "step": step}
        if replayed:
            self.replayed[index] = list(replayed)
            rec["replayed"] = replayed
        self.log.put("lineage", str(index), rec)

    def replayed_from(self, first: int) -> int:
        """Replayed uses in the batches from ``first`` on."""
        return sum(len(ids) for b, ids in self.replayed.items() if b >= first)

    def take_back(self, first: int) -> dict[int, list[str]]:
        """Remove the batches from ``first`` on (the job rolled back before their last
        step); returns them, by index, oldest first."""
        gone = {b: self.batches.pop(b) for b in sorted(self.batches) if b >= first}
        for b in gone:
            self.replayed.pop(b, None)
        for b in gone:
            self.log.put("lineage", str(b), None)
        return gone

    def rollouts(self) -> int:
        """Rollouts in the lineage (the ledger's trained count, when it balances)."""
        return sum(len(ids) for ids in self.batches.values())

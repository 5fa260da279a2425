"""Accepted rollouts and the training batches made of them.

A **rollout** is the group of ``group_size`` completions of one prompt. The
ledger keeps its summary only (id, prompt, weights version, mean reward and
exact match, and the ``ref`` of its payload in the rollout store); the payload
itself lives in the store. A **batch** is the ``prompts_per_step`` rollouts one
policy step trains on: frozen the first time a policy replica asks for that
step, so every member of the quorum (and a retry after a failed commit) gets
the same batch, and trained once the step commits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phalanx.config.rl import RLConfig
from phalanx.controller.core.base import ChangeLog
from phalanx.controller.core.ledger.prompts import PromptBook
from phalanx.controller.core.ledger.sync import WeightSync

Drop = Callable[[str, str], None]
"""``drop(ref, reason)``: a rollout's payload is no longer needed."""


def payload_key(ref: str) -> str:
    """A ledger rollout's key in the controller's payload log."""
    return f"rl/{ref}"


class RolloutBook:
    def __init__(
        self,
        rl: RLConfig,
        log: ChangeLog,
        counts: dict[str, int],
        save: Callable[[], None],
        drop: Drop,
        prompts: PromptBook,
        weights: WeightSync,
    ):
        self.loop, self.grpo = rl.loop, rl.grpo
        self.log, self.counts, self.save, self.drop = log, counts, save, drop
        self.prompts, self.weights = prompts, weights
        self.records: dict[str, dict[str, Any]] = {}
        """Pending and batched rollouts, by id."""
        self.pending: dict[str, dict[str, Any]] = {}
        """Accepted rollouts not yet in a batch, in arrival order."""
        self.batches: dict[int, dict[str, Any]] = {}
        self.reopened: set[int] = set()
        """Batches unfrozen because a payload was lost: frozen again at the next ask."""
        self.seq = 0
        self.next_batch = 0
        self.policy_step = 0
        self.discarded: dict[str, int] = {}
        self.history: list[dict[str, Any]] = []
        self.finished = False

    def meta(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "next_batch": self.next_batch,
            "policy_step": self.policy_step,
            "discarded": self.discarded,
            "finished": self.finished,
            "reopened": sorted(self.reopened),
        }

    def restore(
        self, meta: dict[str, Any], tables: dict[str, dict[str, dict[str, Any]]]
    ) -> list[tuple[str, Any]]:
        """Rebuild from the journal. A record that still holds its completions (a
        journal written before the payload log) has them moved out: returned for
        the payload log, and the record rewritten with its ``ref``."""
        self.seq, self.next_batch = meta["seq"], meta["next_batch"]
        self.policy_step, self.finished = meta["policy_step"], meta["finished"]
        self.discarded = dict(meta["discarded"])
        self.reopened = set(meta.get("reopened", []))
        self.records = dict(tables.get("rollouts", {}))
        moved: list[tuple[str, Any]] = []
        for rid, rec in list(self.records.items()):
            if "ref" in rec:
                continue
            comps = rec.get("completions", [])
            rec = {k: v for k, v in rec.items() if k != "completions"} | {"ref": rid}
            payload = {"rollout_id": rid, "version": rec["version"], "completions": comps}
            moved.append((payload_key(rid), payload))
            self.records[rid] = rec
            self.log.put("rollouts", rid, rec)
        for key in sorted(tables.get("batches", {}), key=int):
            b = tables["batches"][key]
            self.batches[b["index"]] = b
        batched = {rid for b in self.batches.values() for rid in b["rollout_ids"]}
        for rid, rec in sorted(self.records.items(), key=lambda kv: kv[1]["seq"]):
            if rid not in batched:
                self.pending[rid] = rec
        hist = tables.get("rl_history", {})
        self.history = [hist[k] for k in sorted(hist, key=int)]
        return moved

    def batched(self) -> int:
        return sum(len(b["rollout_ids"]) for b in self.batches.values())

    def floor(self) -> int:
        """Oldest version a rollout leased now may be made with and still train."""
        return self.next_batch * self.grpo.inner_epochs - self.loop.max_staleness

    # -- accepting and discarding ----------------------------------------

    def accept(self, rec: dict[str, Any]) -> None:
        self.seq += 1
        rec["seq"] = self.seq
        self.records[rec["rollout_id"]] = self.pending[rec["rollout_id"]] = rec
        self.log.put("rollouts", rec["rollout_id"], rec)
        self.counts["accepted"] += 1

    def discard(
        self, rid: str, reason: str, wall: float, detail: str = "", again: bool = True
    ) -> None:
        """Drop an accepted rollout and dispatch its prompt again (next attempt), unless
        ``again`` is False (the caller retires the prompt)."""
        rec = self.records.pop(rid)
        self.pending.pop(rid, None)
        self.log.put("rollouts", rid, None)
        self.discarded[reason] = self.discarded.get(reason, 0) + 1
        if again:
            self.prompts.again(rec["prompt"])
        if rec["ref"] is not None:  # a rollout submitted as discarded has no payload
            self.drop(rec["ref"], reason)
        extra = {"detail": detail} if detail else {}
        self.log.event(
            "rollout_discarded",
            wall,
            rollout_id=rid,
            reason=reason,
            version=rec["version"],
            **extra,
        )

    def reopen(self, b: int) -> None:
        """Unfreeze batch ``b`` (not trained yet): its rollouts are pending again, oldest
        first, and the next ask for its step freezes a new batch."""
        for rid in self.batches.pop(b)["rollout_ids"]:
            self.pending[rid] = self.records[rid]
        self.log.put("batches", str(b), None)
        self.pending = dict(sorted(self.pending.items(), key=lambda kv: kv[1]["seq"]))
        self.reopened.add(b)

    def batch_of(self, rid: str) -> int | None:
        for b, batch in self.batches.items():
            if rid in batch["rollout_ids"]:
                return b
        return None

    # -- training batches ------------------------------------------------

    def batch_for(self, step: int, *, wall: float) -> dict[str, Any] | None:
        """The frozen batch that policy step ``step`` trains on, freezing it from the
        oldest pending rollouts if this is the first ask. None: not enough fresh
        rollouts yet (ask again). Rollouts too old for the batch are discarded."""
        b = step // self.grpo.inner_epochs
        if b in self.batches:
            return self.batches[b]
        if self.finished:
            return None  # a finished job is not rewound: nothing more will train
        if b >= self.grpo.steps:
            # Past the job's last batch. It is not finished yet only because the last
            # ack waits for its checkpoint: nothing more is frozen meanwhile.
            return None
        if b < self.next_batch and b not in self.reopened:
            self._rewind(b, step, wall)
        floor = b * self.grpo.inner_epochs - self.loop.max_staleness
        for rid in [rid for rid, r in self.pending.items() if r["version"] < floor]:
            self.discard(rid, "stale", wall)
        need = self.grpo.prompts_per_step
        if len(self.pending) < need:
            self.save()
            return None
        ids = list(self.pending)[:need]
        rows = [self.pending.pop(rid) for rid in ids]
        batch = {
            "index": b,
            "step": step,
            "rollout_ids": ids,
            "frozen_at": wall,
            "reward": sum(r["reward"] for r in rows) / need,
            "exact_match": sum(r["exact_match"] for r in rows) / need,
            "staleness": b * self.grpo.inner_epochs - min(r["version"] for r in rows),
        }
        self.batches[b] = batch
        self.reopened.discard(b)
        self.next_batch = max(self.next_batch, b + 1)
        self.log.put("batches", str(b), batch)
        self.save()
        return batch

    def _rewind(self, b: int, step: int, wall: float) -> list[int]:
        """Every replica that trained batch ``b`` is gone and the state went with
        them: training restarts from an older step and gets fresh batches. Returns
        the batches unfrozen (their rollouts go back to pending)."""
        self.log.event("policy_rewind", wall, from_batch=self.next_batch, to_batch=b)
        self.next_batch = b
        self.policy_step = min(self.policy_step, step)
        self.weights.rewind(step)
        # The metrics of the lost training go too: the journal keys history by
        # batch, so a retrained batch would overwrite its entry there but not
        # here, and the finish test must only average the surviving lineage.
        while self.history and self.history[-1]["batch"] >= b:
            self.log.put("rl_history", str(self.history.pop()["batch"]), None)
        # Batches the lost replicas froze ahead are unfrozen, so that next_batch
        # stays past every frozen batch (else a later ask would freeze a second
        # batch under an index already used) and their rollouts, oldest first,
        # go through the staleness check of the new lineage.
        ahead = [k for k in self.batches if k > b]
        for k in ahead:
            self.reopen(k)
        self.reopened -= set(ahead)
        return ahead

    def trained(self, step: int, *, wall: float, metrics: dict[str, float] | None = None) -> None:
        """Policy step count ``step`` is committed but maybe not yet in a checkpoint:
        the batches it covers keep when they were trained and what the policy measured
        (``metrics``), for the ack that drops them (:meth:`ack`). Idempotent."""
        inner = self.grpo.inner_epochs
        for b, batch in self.batches.items():
            if (b + 1) * inner <= step and "trained_at" not in batch:
                batch["trained_at"] = wall
                if metrics:
                    batch["metrics"] = dict(metrics)
                self.log.put("batches", str(b), batch)

    def ack(self, step: int, *, wall: float, metrics: dict[str, float] | None = None) -> bool:
        """Policy step count ``step`` is committed and durable: every batch it covers
        is trained, and dropped. Returns True when this moved the ledger (idempotent
        per step)."""
        self.trained(step, wall=wall, metrics=metrics)
        inner = self.grpo.inner_epochs
        if step <= self.policy_step and not any((b + 1) * inner <= step for b in self.batches):
            return False
        self.policy_step = max(self.policy_step, step)
        for b in sorted(self.batches):
            if (b + 1) * inner > step:
                continue
            batch = self.batches.pop(b)
            self.log.put("batches", str(b), None)
            for rid in batch["rollout_ids"]:
                rec = self.records.pop(rid)
                self.log.put("rollouts", rid, None)
                self.prompts.trained(rec["prompt"])
                self.drop(rec["ref"], "trained")
                self.counts["trained_prompts"] += 1
                self.counts["trained_rollouts"] += 1
                self.counts["trained_completions"] += self.grpo.group_size
            self._record(batch, wall)
        return True

    def _record(self, batch: dict[str, Any], wall: float) -> None:
        """The history entry of a trained batch, stamped with when it was trained (its
        ack may come later, with the checkpoint), with the policy's figures of it."""
        at, metrics = batch.get("trained_at", wall), batch.get("metrics")
        w = self.loop.window
        prev = self.history[-(w - 1) :] if w > 1 else []  # history[-0:] would be all of it
        recent = [h["exact_match"] for h in prev] + [batch["exact_match"]]
        recent_r = [h["reward"] for h in prev] + [batch["reward"]]
        h = {
            "batch": batch["index"],
            "step": self.policy_step,
            "reward": round(batch["reward"], 5),
            "exact_match": round(batch["exact_match"], 5),
            "reward_avg": round(sum(recent_r) / len(recent_r), 5),
            "exact_match_avg": round(sum(recent) / len(recent), 5),
            "staleness": batch["staleness"],
            "at": at,
        }
        if metrics:
            h["metrics"] = dict(metrics)
            tokens = metrics.get("tokens")
            before = self.history[-1]["at"] if self.history else None
            if tokens is not None and before is not None and at > before:
                h["tokens_per_s"] = round(tokens / (at - before), 1)
        self.history.append(h)
        self.log.put("rl_history", str(batch["index"]), h)
        while len(self.history) > self.loop.history:
            old = self.history.pop(0)
            self.log.put("rl_history", str(old["batch"]), None)
        target, target_r = self.loop.target_exact_match, self.loop.target_reward
        full = len(recent) == w
        if not self.finished and (
            (target is not None and full and h["exact_match_avg"] >= target)
            or (target_r is not None and full and h["reward_avg"] >= target_r)
            or batch["index"] + 1 >= self.grpo.steps
        ):
            self.finished = True
            self.log.event(
                "rl_finished",
                wall,
                batch=batch["index"],
                step=self.policy_step,
                exact_match_avg=h["exact_match_avg"],
            )

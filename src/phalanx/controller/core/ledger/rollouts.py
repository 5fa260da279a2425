"""Accepted rollouts and the training batches made of them.

A **rollout** is the group of ``group_size`` completions of one prompt. The
ledger keeps its summary only (id, prompt, weights version, mean reward and
exact match, and the ``ref`` of its payload in the rollout store); the payload
itself lives in the store. A **batch** is the ``prompts_per_step`` rollouts one
policy step trains on: frozen the first time a policy replica asks for that
step, so every member of the quorum (and a retry after a failed commit) gets
the same batch, and trained once the step commits.

**The end.** The job's last step (``final_step``) is decided as soon as a step
that covers its last batch commits: the batch count, or the reward target met
over the window of the lineage's latest batches. No batch is frozen past it, so
every policy replica stops at the same step. The job is *finished* once a save
holds that step (its ack), not before: a last step lost before that is rolled
back like any other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phalanx.config.rl import RLConfig
from phalanx.controller.core.base import ChangeLog
from phalanx.controller.core.ledger.lineage import LineageBook
from phalanx.controller.core.ledger.prompts import PromptBook
from phalanx.controller.core.ledger.replay import ReplayBook, ReplayUnavailable
from phalanx.controller.core.ledger.sync import WeightSync
from phalanx.protocol.rl import parse_rollout_id

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
        replay: ReplayBook,
    ):
        self.loop, self.grpo = rl.loop, rl.grpo
        self.replay = replay
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
        """The figures of the lineage's batches, as each committed (the last
        ``loop.history``)."""
        self.finished = False
        self.final_step: int | None = None
        """The job's last step, once a commit decided it (module doc)."""
        self.lineage = LineageBook(log)

    def meta(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "next_batch": self.next_batch,
            "policy_step": self.policy_step,
            "discarded": self.discarded,
            "finished": self.finished,
            "final_step": self.final_step,
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
        self.final_step = meta.get("final_step")
        self.lineage.restore(tables)
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

    def pinned(self) -> set[str]:
        """Replay entries drawn into the frozen batches (their payloads are needed)."""
        return {r["rollout_id"] for b in self.batches.values() for r in b.get("replayed", [])}

    def batched_replayed(self) -> int:
        return sum(len(b.get("replayed", [])) for b in self.batches.values())

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

    def lose_replayed(self, rid: str, reason: str) -> list[int]:
        """A replay entry's payload could not be read: it leaves the replay, and the
        untrained batches that drew it are unfrozen (drawn again at the next ask).
        Returns those batches."""
        batches = [
            b
            for b, batch in self.batches.items()
            if "trained_at" not in batch
            and any(r["rollout_id"] == rid for r in batch.get("replayed", []))
        ]
        for b in batches:
            self.reopen(b)
        if self.replay.forget(rid, reason) or batches:
            self.counts["replay_lost"] += 1
            self.save()
        return batches

    # -- training batches ------------------------------------------------

    def batch_for(self, step: int, *, wall: float) -> dict[str, Any] | None:
        """The frozen batch that policy step ``step`` trains on, freezing it from the
        oldest pending rollouts if this is the first ask. None: not enough fresh
        rollouts yet (ask again). Rollouts too old for the batch are discarded."""
        b = step // self.grpo.inner_epochs
        if self.final_step is not None and step >= self.final_step:
            return None  # the job's last step: every replica stops here
        if b in self.batches:
            return self.batches[b]
        if self.finished:
            return None  # a finished job is not rewound: nothing more will train
        if b >= self.grpo.steps:
            # Past the job's last batch. It is not finished yet only because the last
            # ack waits for its checkpoint: nothing more is frozen meanwhile.
            return None
        if b < self.next_batch and b not in self.reopened:
            # Below the ledger, with no rollback on record: quorum formation makes
            # sure this cannot happen. Never silently: it is a rollback all the same.
            frm = self.next_batch * self.grpo.inner_epochs
            figures = self.rollback(step, wall=wall)
            self.weights.rewind(step)
            self.log.event(
                "rollback",
                wall,
                role="policy",
                from_step=frm,
                to_step=step,
                reason=f"a policy replica asked for batch {b}, behind the ledger's {frm}",
                **figures,
            )
        floor = b * self.grpo.inner_epochs - self.loop.max_staleness
        for rid in [rid for rid, r in self.pending.items() if r["version"] < floor]:
            self.discard(rid, "stale", wall)
        need = self.grpo.prompts_per_step
        replayed = self._draw(b, need, wall)
        if replayed is None:
            self.save()
            return None
        fresh = need - len(replayed)
        ids = list(self.pending)[:fresh]
        rows = [self.pending.pop(rid) for rid in ids]
        batch = {
            "index": b,
            "step": step,
            "rollout_ids": ids,
            "frozen_at": wall,
            # The figures are the fresh rollouts': the finish test follows the policy
            # as it is now, not the replay's past.
            "reward": sum(r["reward"] for r in rows) / fresh,
            "exact_match": sum(r["exact_match"] for r in rows) / fresh,
            "staleness": b * self.grpo.inner_epochs - min(r["version"] for r in rows),
        }
        if replayed:
            batch["replayed"] = replayed
        self.batches[b] = batch
        self.reopened.discard(b)
        self.next_batch = max(self.next_batch, b + 1)
        self.log.put("batches", str(b), batch)
        self.save()
        return batch

    def _draw(self, b: int, need: int, wall: float) -> list[dict[str, Any]] | None:
        """The replay entries batch ``b`` trains on (module :mod:`.replay`), or None when
        the fresh rollouts pending are too few for the rest (ask again). A replay that
        cannot be reached gives none: the batch is frozen fresh only, and that is
        counted (``replay_unavailable``) and told (an event)."""
        k = self.replay.per_batch
        if len(self.pending) < need - k:
            return None  # too few even with a full draw: the server is not asked
        if k == 0:
            return []
        try:
            drawn = self.replay.draw(b, k, self.replay.size(wall))
        except ReplayUnavailable as e:
            if len(self.pending) < need:
                return None  # wait for fresh ones to fill the batch, asking again
            self.counts["replay_unavailable"] += 1
            self.log.event("replay_unavailable", wall, batch=b, error=str(e)[:300])
            return []
        return drawn if len(self.pending) >= need - len(drawn) else None

    def rollback(self, to_step: int, *, wall: float) -> dict[str, int]:
        """The policy's step went back to ``to_step``: every replica and checkpoint that
        held the later steps is gone (:mod:`..quorum` waited for one). What they trained
        leaves the lineage: a batch trained durably past ``to_step`` is taken back, its
        prompts issued again (a new attempt each) and its rollouts counted as discarded
        (``rolled_back``). The batch ``to_step`` trains next stays frozen when it still
        is (its payloads are there: the steps on it are retrained), and the batches
        frozen past it are unfrozen, their rollouts pending again, oldest first. Returns
        the figures: ``batches`` the lineage lost, ``prompts`` issued again."""
        inner = self.grpo.inner_epochs
        first = to_step // inner  # the first batch the lineage no longer holds whole
        lost = sum(1 for b, batch in self.batches.items() if b >= first and "trained_at" in batch)
        again = 0
        self.counts["replayed_rollouts"] -= self.lineage.replayed_from(first)
        taken = self.lineage.take_back(first)
        for ids in taken.values():
            for rid in ids:
                idx, attempt = parse_rollout_id(rid)
                self.prompts.reissue(idx, attempt + 1)
                again += 1
        n = again
        self.counts["trained_prompts"] -= n
        self.counts["trained_rollouts"] -= n
        self.counts["trained_completions"] -= n * self.grpo.group_size
        if n:
            self.discarded["rolled_back"] = self.discarded.get("rolled_back", 0) + n
        for k in sorted(self.batches):
            if k > first:
                self.reopen(k)
                self.reopened.discard(k)  # frozen again from the pending, in order
            elif k == first and "trained_at" in self.batches[k]:
                batch = self.batches[k]
                batch.pop("trained_at")
                batch.pop("metrics", None)
                self.log.put("batches", str(k), batch)
        self.next_batch = first + 1 if first in self.batches else first
        self.policy_step = min(self.policy_step, to_step)
        if self.final_step is not None and self.final_step > to_step:
            self.final_step = None  # the lineage that met the target is gone
        # The figures of the lost training go too: the finish test averages the
        # lineage's batches, and a retrained batch gets an entry of its own.
        while self.history and self.history[-1]["batch"] >= first:
            self.log.put("rl_history", str(self.history.pop()["batch"]), None)
        self.save()
        return {"batches": len(taken) + lost, "prompts": again}

    def trained(self, step: int, *, wall: float, metrics: dict[str, float] | None = None) -> None:
        """Policy step count ``step`` is committed but maybe not yet in a checkpoint:
        each batch it covers joins the history, with when it was trained and what the
        policy measured (``metrics``, of the newest batch it covers), and the job's last
        step is decided when one meets the end (module doc). Idempotent; metrics that
        come after the batch was marked (another replica's ask reported the step
        first) are added to it then."""
        inner = self.grpo.inner_epochs
        covered = sorted(b for b in self.batches if (b + 1) * inner <= step)
        for b in covered:
            batch = self.batches[b]
            fresh = "trained_at" not in batch
            if fresh:
                batch["trained_at"] = wall
            if metrics and b == covered[-1] and "metrics" not in batch:
                batch["metrics"] = dict(metrics)
            elif not fresh:
                continue
            self.log.put("batches", str(b), batch)
            self._record(batch, wall)

    def ack(self, step: int, *, wall: float, metrics: dict[str, float] | None = None) -> bool:
        """Policy step count ``step`` is committed and durable: every batch it covers
        is trained (in the lineage), and dropped; once that reaches the job's last
        step, the job is finished. Returns True when this moved the ledger
        (idempotent per step)."""
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
            replayed = [r["rollout_id"] for r in batch.get("replayed", [])]
            self.counts["replayed_rollouts"] += len(replayed)
            for rid in batch["rollout_ids"]:
                rec = self.records.pop(rid)
                self.log.put("rollouts", rid, None)
                self.prompts.trained(rec["prompt"])
                if not self.replay.keep(rec, self.pinned()):
                    self.drop(rec["ref"], "trained")
                self.counts["trained_prompts"] += 1
                self.counts["trained_rollouts"] += 1
                self.counts["trained_completions"] += self.grpo.group_size
            self.lineage.add(b, batch["rollout_ids"], (b + 1) * inner, replayed)
        final = self.final_step
        if not self.finished and final is not None and self.policy_step >= final:
            self.finished = True
            last = self.history[-1] if self.history else {}
            self.log.event(
                "rl_finished",
                wall,
                batch=last.get("batch"),
                step=final,
                exact_match_avg=last.get("exact_match_avg"),
            )
        return True

    def _record(self, batch: dict[str, Any], wall: float) -> None:
        """The history entry of a batch just trained (committed: its ack, with the
        checkpoint, may come later), with the policy's figures of it; an entry for it
        already there (marked before its metrics came) is replaced. Decides the job's
        last step when this batch ends it."""
        at, metrics = batch.get("trained_at", wall), batch.get("metrics")
        if self.history and self.history[-1]["batch"] == batch["index"]:
            self.history.pop()
        w = self.loop.window
        prev = self.history[-(w - 1) :] if w > 1 else []  # history[-0:] would be all of it
        recent = [h["exact_match"] for h in prev] + [batch["exact_match"]]
        recent_r = [h["reward"] for h in prev] + [batch["reward"]]
        step = (batch["index"] + 1) * self.grpo.inner_epochs
        h = {
            "batch": batch["index"],
            "step": step,
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
        if self.final_step is None and (
            (target is not None and full and h["exact_match_avg"] >= target)
            or (target_r is not None and full and h["reward_avg"] >= target_r)
            or batch["index"] + 1 >= self.grpo.steps
        ):
            self.final_step = step
            self.log.event(
                "rl_final_step",
                wall,
                batch=batch["index"],
                step=step,
                exact_match_avg=h["exact_match_avg"],
                reward_avg=h["reward_avg"],
            )
            self.save()

"""The RL ledger: prompt leases, rollouts, training batches and weight syncs.

Part of the controller's pure core (no I/O, no clock: every call takes
``now``/``wall``), journaled through the same change log as membership. It is
composed of these books:

- :class:`~.prompts.PromptBook`: the cursor, prompts in flight, their leases;
- :class:`~.rollouts.RolloutBook`: accepted rollouts and training batches;
- :class:`~.sync.WeightSync`: weight-sync orders and the replicas' versions;
- :class:`~.replay.ReplayBook`: the replay memory of trained rollouts that a
  share of each batch is drawn from (``rl.loop.replay_ratio``);
- :class:`~.episodes.EpisodeBook`: the multi-turn episodes' progress reported
  against leases, carried by their prompts when dispatched again.

The ledger records each rollout's id, prompt, weights version, state and
summary figures, and the ``ref`` of its payload, never the payload itself: the
completions live in the job's rollout store (the controller's payload log by
default, or Redis or storage). When a rollout is trained or discarded, its
payload is dropped from the store (:attr:`Ledger.drops`).

Where each prompt is, at every moment (:meth:`Ledger.balance` checks it)::

    issued (cursor) = queued + leased + done + trained
    accepted rollouts = pending + batched + trained + discarded (by reason)

Replayed uses are counted apart (``replay`` in the balance: ``batched`` in frozen
batches, ``replayed`` in trained ones), so a rollout trained again from the
replay never counts twice among the accepted ones.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from phalanx.config.rl import RLConfig
from phalanx.controller.core.base import ChangeLog, Tick
from phalanx.controller.core.ledger.episodes import EpisodeBook
from phalanx.controller.core.ledger.prompts import Lease, PromptBook
from phalanx.controller.core.ledger.replay import RemoteReplay, ReplayBook
from phalanx.controller.core.ledger.rollouts import RolloutBook, payload_key
from phalanx.controller.core.ledger.submission import check_submission, record, rollout_prompt
from phalanx.controller.core.ledger.sync import Sync, WeightSync
from phalanx.protocol.rl import RolloutIn
from phalanx.protocol.status import LedgerStatus

__all__ = ["Lease", "Ledger", "RemoteReplay", "Sync", "payload_key", "rollout_prompt"]


class Ledger:
    """Prompt dispatch, the rollout ledger and weight-sync orders of one RL job."""

    def __init__(
        self,
        rl: RLConfig,
        log: ChangeLog,
        *,
        run: str,
        sync_timeout_s: float = 60.0,
        external_store: bool = False,
        first_mesh_hold_s: float = 0.0,
        seed: int = 0,
    ):
        """``seed``: the job's seed, which with the batch index decides each batch's
        draw from the replay."""
        self.rl, self.log = rl, log
        self.loop, self.grpo = rl.loop, rl.grpo
        self.run = run
        """This run of the job (journaled: a restarted controller keeps it). Rollout ids
        restart at p0.0 in every fresh run, so stores outside the controller (Redis, a
        bucket) keep runs apart under it, or a rerun's rollouts would look like duplicates."""
        self.external_store = external_store
        """Payloads live outside the controller: submissions carry refs, and drops are
        journaled until the controller's collector has made them."""
        self.counts: dict[str, int] = {
            "trained_prompts": 0,
            "dropped_prompts": 0,
            "trained_rollouts": 0,
            "trained_completions": 0,
            "accepted": 0,
            "duplicates": 0,
            "unleased": 0,
            "leases_issued": 0,
            "leases_expired": 0,
            "replay_added": 0,
            "replay_evicted": 0,
            "replayed_rollouts": 0,
            "replay_lost": 0,
            "replay_unavailable": 0,
        }
        self.prompts = PromptBook(log, self.counts, self.save, self.loop.lease_s)
        self.weights = WeightSync(log, self.save, sync_timeout_s, first_mesh_hold_s)
        replay = rl.transport.replay
        self.replay = ReplayBook(
            log,
            self.counts,
            self._drop,
            kind=None if replay is None else "memory" if replay == "memory" else "redis",
            capacity=rl.transport.replay_size,
            seed=seed,
            prompts_per_step=rl.grpo.prompts_per_step,
            ratio=rl.loop.replay_ratio,
        )
        self.rollouts = RolloutBook(
            rl, log, self.counts, self.save, self._drop, self.prompts, self.weights, self.replay
        )
        self.puts: list[tuple[str, Any]] = []
        """(key, payload) of rollouts accepted and episode progress kept by the last
        calls, for the controller's payload log (written before the commit)."""
        self.drops: list[str] = []
        """Payload-log keys no longer needed by the last calls (dropped after the commit)."""
        self.sweeps: list[tuple[str, str]] = []
        """(ref, reason) to drop from the external rollout store (by the collector)."""
        self.unswept: dict[str, str] = {}
        """External store: drops journaled and not yet made (ref -> reason)."""
        cap, g = rl.loop.episode_bytes, rl.grpo.group_size
        put, drop = self.puts.append, self.drops.append  # the payload log's, always
        self.episodes = EpisodeBook(
            log, self.counts, self.save, cap_bytes=cap, group_size=g, put=put, drop=drop
        )

    # -- persistence -----------------------------------------------------

    def save(self) -> None:
        self.log.put(
            "ledger",
            "meta",
            {
                **self.prompts.meta(),
                **self.rollouts.meta(),
                **self.weights.meta(),
                "counts": self.counts,
                "run": self.run,
            },
        )

    def restore(
        self, tables: dict[str, dict[str, dict[str, Any]]], now: float
    ) -> list[tuple[str, Any]]:
        """Rebuild from the journal; returns payloads moved out of old records (a
        journal written before the payload log), for the payload log."""
        self.unswept = {k: v["reason"] for k, v in tables.get("payload_drops", {}).items()}
        meta = tables.get("ledger", {}).get("meta")
        if meta is None:
            return []
        self.counts.update(meta["counts"])
        self.run = meta.get("run", self.run)
        self.prompts.restore(meta, tables, now)
        moved = self.rollouts.restore(meta, tables)
        self.replay.restore(tables)
        self.weights.restore(meta)
        self.episodes.restore(tables)
        return moved

    def _drop(self, ref: str, reason: str) -> None:
        if not self.external_store:
            self.drops.append(payload_key(ref))
            return
        self.sweeps.append((ref, reason))
        self.unswept[ref] = reason
        self.log.put("payload_drops", ref, {"reason": reason})

    def swept(self, refs: Iterable[str]) -> None:
        """The collector dropped these payloads from the external store."""
        for ref in refs:
            if self.unswept.pop(ref, None) is not None:
                self.log.put("payload_drops", ref, None)

    def take(self, tick: Tick) -> Tick:
        """Move the payloads to store and to drop that the last calls decided into ``tick``."""
        tick.puts += self.puts
        tick.drops += self.drops
        tick.sweeps += self.sweeps
        for made in (self.puts, self.drops, self.sweeps):
            made.clear()  # in place: the episode book appends to these very lists
        return tick

    # -- accounting ------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.rollouts.finished

    @property
    def policy_step(self) -> int:
        return self.rollouts.policy_step

    @property
    def final_step(self) -> int | None:
        return self.rollouts.final_step

    def rollback(self, from_step: int, to_step: int, *, wall: float) -> dict[str, int]:
        """The policy's step went back from ``from_step`` to ``to_step`` (no replica and
        no checkpoint holds the steps past it): the ledger follows
        (:meth:`RolloutBook.rollback`), and the weight versions rewind with it."""
        figures = self.rollouts.rollback(to_step, wall=wall)
        self.weights.rewind(to_step)
        self.save()
        return figures

    def balance(self) -> dict[str, Any]:
        """Where every prompt and rollout is. ``ok`` is the ledger's invariant."""
        states = self.prompts.states()
        c, ro = self.counts, self.rollouts
        batched = ro.batched()
        discarded = sum(ro.discarded.values())
        dropped = c.get("dropped_prompts", 0)
        prompts_ok = self.prompts.cursor == sum(states.values()) + c["trained_prompts"] + dropped
        rollouts_ok = c["accepted"] == len(ro.pending) + batched + c["trained_rollouts"] + discarded
        return {
            "ok": prompts_ok and rollouts_ok,
            "prompts": {
                "issued": self.prompts.cursor,
                **states,
                "trained": c["trained_prompts"],
                "dropped": dropped,
            },
            "rollouts": {
                "accepted": c["accepted"],
                "pending": len(ro.pending),
                "batched": batched,
                "trained": c["trained_rollouts"],
                "discarded": dict(ro.discarded),
                "duplicates_dropped": c["duplicates"],
                "unleased_refused": c.get("unleased", 0),
            },
            "leases": {
                "open": len(self.prompts.leases),
                "issued": c["leases_issued"],
                "expired": c["leases_expired"],
            },
            **(
                {"replay": self.replay.status(ro.batched_replayed())}
                if self.replay.kind is not None
                else {}
            ),
        }

    def status(self) -> LedgerStatus:
        hist = self.rollouts.history
        return LedgerStatus.model_validate(
            {
                **self.balance(),
                "policy_step": self.rollouts.policy_step,
                "next_batch": self.rollouts.next_batch,
                "run": self.run,
                "leased_by": self.prompts.leased_by(),
                "finished": self.rollouts.finished,
                "final_step": self.rollouts.final_step,
                "last": hist[-1] if hist else None,
                "history": hist[-200:],
                "weights": self.weights.status(),
                "episodes": self.episodes.status(),
                **({"payloads": {"unswept": len(self.unswept)}} if self.external_store else {}),
            },
            strict=False,  # built here: lists stand for tuples
        )

    # -- prompt leases (rollout replicas) --------------------------------

    def lease(
        self, replica_id: str, version: int, max_prompts: int, *, now: float, wall: float
    ) -> Lease | None:
        """Lease up to ``max_prompts`` prompts to a rollout replica holding ``version``
        (-1: no weights yet). None when the job is finished, when the replica's
        weights are too old (it must sync first), or under backpressure."""
        self.weights.versions[replica_id] = version
        if self.finished or version < 0 or version < self.rollouts.floor():
            return None
        outstanding = self.prompts.outstanding() + len(self.rollouts.pending)
        room = self.loop.max_ahead * self.replay.fresh_per_batch() - outstanding
        return self.prompts.lease(replica_id, version, max_prompts, room, now=now, wall=wall)

    def expire(self, now: float, wall: float) -> bool:
        return self.prompts.expire(now, wall)

    def drop_replica(self, replica_id: str, wall: float) -> bool:
        """A replica left or was evicted: its leases go back at once, and an in-flight
        sync that counts on it is abandoned. True if it held prompts."""
        self.weights.versions.pop(replica_id, None)
        held = self.prompts.drop_holder(replica_id, wall)
        self.weights.drop_member(replica_id, wall)
        return held

    # -- rollouts --------------------------------------------------------

    def submit(
        self, replica_id: str, lease_id: str, rollouts: list[RolloutIn], *, now: float, wall: float
    ) -> dict[str, list[str]]:
        """Record a lease's rollouts. Each is accepted once by id; a later copy (late
        submission of an expired lease, a retry) is dropped as a duplicate, and one
        made with too old weights is discarded as stale. A rollout of a prompt attempt
        that ``lease_id`` never held for ``replica_id`` (a prompt never issued, a made-up
        lease, another replica's lease) is refused as ``unleased`` and counted apart.
        Validates everything before recording anything. Returns the ids by verdict:
        ``accepted``, ``duplicate``, ``stale``, ``unleased``."""
        check_submission(rollouts, self.rl, self.external_store)
        out: dict[str, list[str]] = {
            "accepted": [],
            "duplicate": [],
            "stale": [],
            "unleased": [],
            "discarded": [],
        }
        floor = self.rollouts.floor()
        for r in rollouts:
            rid = r.rollout_id
            idx, attempt = rollout_prompt(rid)
            verdict = self.prompts.verdict(idx, attempt, lease_id, replica_id)
            if verdict != "accept":
                self.counts["duplicates" if verdict == "duplicate" else "unleased"] += 1
                out[verdict].append(rid)
                if r.ref is not None:
                    self._drop(r.ref, verdict)
                continue
            self.prompts.done(idx, lease_id)
            self.episodes.forget(idx)  # its rollout is in: no episode of it resumes
            if r.discard:  # could not be scored: on record; its prompt is dropped
                self.rollouts.accept(record(r, idx, replica_id, None))
                self.rollouts.discard(rid, "reward_error", wall, detail=r.discard, again=False)
                self.prompts.trained(idx)  # leaves the book, as a trained prompt does
                self.counts["dropped_prompts"] += 1
                out["discarded"].append(rid)
                continue
            ref = r.ref if r.ref is not None else rid
            if r.ref is None and r.version >= floor:  # a stale one is discarded below
                self.puts.append((payload_key(ref), r.payload()))
            self.rollouts.accept(record(r, idx, replica_id, ref))
            if r.version < floor:
                self.rollouts.discard(rid, "stale", wall)
                out["stale"].append(rid)
            else:
                out["accepted"].append(rid)
        self.prompts.settle_lease(lease_id)
        self.save()
        return out

    def reconcile(self, payload_of: Callable[[str], Any], *, wall: float) -> Tick:
        """At start: rollouts whose payloads ``payload_of`` (the payload log) does not
        hold (a torn write, a lost file) are discarded as ``payload_missing`` and
        their prompts dispatched again."""
        lost = [
            (rid, "payload_missing")
            for rid, rec in self.rollouts.records.items()
            if payload_of(payload_key(rec["ref"])) is None
        ]
        self.lose(lost, wall=wall)
        kept = {**self.replay.entries, **self.replay.out}
        for rid, row in kept.items():
            if payload_of(payload_key(row["ref"])) is None:
                self.lose([(rid, "payload_missing")], wall=wall)
                self.replay.forget(rid, "payload_missing", unwritten=True)
        return self.take(Tick())

    def lose(self, lost: list[tuple[str, str]], *, wall: float) -> tuple[list[str], list[int]]:
        """Rollouts whose payloads could not be read (``(rollout id, reason)``): discard
        them under the reason, dispatch their prompts again, and unfreeze the
        untrained batches they were in. Returns (discarded ids, batches reopened)."""
        discarded: list[str] = []
        reopened: list[int] = []
        for rid, reason in lost:
            if rid not in self.rollouts.records:
                reopened += self.rollouts.lose_replayed(rid, reason)
                continue  # trained or discarded already: nothing left to lose
            b = self.rollouts.batch_of(rid)
            if b is not None:
                self.rollouts.reopen(b)
                reopened.append(b)
            self.rollouts.discard(rid, reason, wall)
            discarded.append(rid)
        if discarded:
            self.save()
        return discarded, reopened

    # -- training batches (policy replicas) ------------------------------

    def batch_for(self, step: int, *, wall: float, own: bool = False) -> dict[str, Any] | None:
        """The frozen batch of ``step``. ``own``: ``step`` is a DiLoCo slot's own batch
        index (``inner_epochs = 1``); the unfrozen indices below it are frozen first, in
        order, so that slots asking out of order leave no gap."""
        if own:
            for b in range(self.rollouts.next_batch, step):
                if self.rollouts.batch_for(b, wall=wall) is None:
                    return None
        return self.rollouts.batch_for(step, wall=wall)

    def committed(self, step: int, *, wall: float, metrics: dict[str, float] | None = None) -> None:
        """The policy committed ``step`` steps, in memory at least: weights may sync
        from it, and the batches it covers keep ``metrics`` for their ack. A step
        behind the wanted version means every replica that held the newer state is
        gone and training resumed from a checkpoint: the versions rewind with it, so
        the resumed lineage is synced anew."""
        w = self.weights
        before = (w.want_version, w.synced_version)
        if step < w.want_version:
            self.log.event("policy_behind", wall, step=step, want_version=w.want_version)
            w.rewind(step)
        w.committed(step, self.loop.sync_every, wall)
        self.rollouts.trained(step, wall=wall, metrics=metrics)
        if (w.want_version, w.synced_version) != before:
            self.save()

    def ack(
        self,
        step: int,
        *,
        wall: float,
        metrics: dict[str, float] | None = None,
        durable: int | None = None,
    ) -> bool:
        """Policy step count ``step`` is committed (see :meth:`committed`), and
        ``min(step, durable)`` is in a checkpoint (``durable`` None: all of ``step``):
        the batches that covers are trained and dropped. Returns True when this
        dropped any (idempotent per step)."""
        self.committed(step, wall=wall, metrics=metrics)
        acked = step if durable is None else min(step, durable)
        if acked <= 0 or not self.rollouts.ack(acked, wall=wall):
            return False
        if self.finished:
            self.episodes.clear()
        self.save()
        return True

    def maybe_sync(
        self,
        leader: tuple[str, str] | None,
        rollout_ids: Iterable[str],
        *,
        inflight: Iterable[str] = (),
        relays: Mapping[str, str] | None = None,
        n_init: int = 1,
        now: float,
        wall: float,
    ) -> Sync | None:
        return self.weights.maybe_sync(
            leader,
            rollout_ids,
            self.prompts.busy(),
            inflight=inflight,
            relays=relays,
            n_init=n_init,
            finished=self.finished,
            now=now,
            wall=wall,
        )

"""The RL requests of the core: prompt leases, rollout submissions, episode
progress, batch leases and acks, weight-sync reports, lost payloads.

Membership checks and wake-ups are done here, the bookkeeping in
:class:`~phalanx.controller.core.ledger.Ledger`. Every method takes
``now``/``wall`` and returns ``(reply, Tick)`` like the rest of the core; the
replies are those of :mod:`phalanx.protocol.rl`. A batch carries each
rollout's payload, read through the ``payload_of`` lookup of the controller's
payload log, or, with a rollout store outside the controller, its ref.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from phalanx.controller.core.base import PayloadOf, StateError, Tick
from phalanx.controller.core.ledger import Ledger, payload_key
from phalanx.controller.core.membership import Membership
from phalanx.controller.core.records import Member, RoleState
from phalanx.protocol.episode import EpisodeProgress, EpisodeProgressReply
from phalanx.protocol.rl import (
    Batch,
    BatchAckReply,
    BatchLeaseReply,
    BatchRollout,
    LostReply,
    PromptLease,
    PromptLeaseReply,
    PromptRef,
    RolloutIn,
    RolloutPayload,
    SubmitReply,
    SyncDoneReply,
    SyncPollReply,
)

Envelope = Callable[[], dict[str, Any]]
"""The fields every reply carries (epoch, job id)."""


class RLRequests:
    def __init__(
        self,
        ledger: Ledger | None,
        members: Membership,
        roles: dict[str, RoleState],
        envelope: Envelope,
        payload_of: PayloadOf,
    ):
        self.ledger, self.members, self.roles = ledger, members, roles
        self.envelope, self.payload_of = envelope, payload_of

    def _ledger(self, replica_id: str, *roles: str) -> tuple[Member, Ledger]:
        if self.ledger is None:
            raise StateError(
                "this job has no RL ledger: the controller's config has no [rl] section. "
                "Start the controller with the RL job's TOML.",
            )
        m = self.members.member(replica_id)
        if m.role not in roles:
            want = " or ".join(repr(r) for r in roles)
            raise StateError(
                f"replica {replica_id!r} must have role {want} for this request: got {m.role!r}.",
                field="replica_id",
            )
        return m, self.ledger

    def _tick(self, led: Ledger, tick: Tick | None = None) -> Tick:
        """``tick`` with the payloads the ledger decided to store and drop."""
        return led.take(tick or Tick())

    def leader(self) -> tuple[str, str] | None:
        """The policy leader (rank 0 of the newest policy quorum), if still a member."""
        q = self.roles["policy"].last_quorum
        if q is None or not q.members or q.members[0].replica_id not in self.members.members:
            return None
        return q.members[0].replica_id, q.members[0].address

    def maybe_sync(self, now: float, wall: float) -> Tick:
        if self.ledger is None:
            return Tick()
        rs = self.roles["rollout"]
        relays, inflight = {}, set()
        for rid in rs.member_ids:
            m = self.members.members[rid]
            if m.capabilities.get("relays_weights") and m.address:
                relays[rid] = m.address
            if m.capabilities.get("inflight_updates"):
                inflight.add(rid)
        order = self.ledger.maybe_sync(
            self.leader(),
            rs.member_ids,
            inflight=inflight,
            relays=relays,
            n_init=rs.cfg.n_init_replicas,
            now=now,
            wall=wall,
        )
        return Tick(ledger_for=set(order.members)) if order is not None else Tick()

    def tick(self, now: float, wall: float) -> Tick:
        """Deadlines: expired prompt leases, timed-out syncs."""
        if self.ledger is None:
            return Tick()
        tick = Tick()
        if self.ledger.expire(now, wall):
            tick.ledger_for |= self.roles["rollout"].member_ids
        return tick.merge(self.maybe_sync(now, wall))

    def evicted(self, replica_id: str, wall: float) -> Tick:
        if self.ledger is not None and self.ledger.drop_replica(replica_id, wall):
            return Tick(ledger_for=set(self.roles["rollout"].member_ids))
        return Tick()

    def lease_prompts(
        self, replica_id: str, version: int, max_prompts: int, *, now: float, wall: float
    ) -> tuple[PromptLeaseReply, Tick]:
        """A rollout replica asks for prompts. The reply carries the lease (or None),
        the sync order it must take part in first (or None), and the job's state."""
        m, led = self._ledger(replica_id, "rollout")
        self.members.touch(m, now)
        led.weights.versions[replica_id] = version  # before deciding whether anyone syncs
        tick = self.maybe_sync(now, wall)
        # roles.rollout.min_replicas: below it no prompt is leased (the replicas there
        # wait, syncing as ordered, until enough have registered again).
        rs = self.roles["rollout"]
        short = len(rs.member_ids) < rs.cfg.min_replicas
        lease = None if short else led.lease(replica_id, version, max_prompts, now=now, wall=wall)
        wire = None
        if lease is not None:
            refs = []
            for i in lease.prompts:
                rid = led.prompts.by_index[i].rollout_id
                resume = led.episodes.resume(
                    i,
                    rid,
                    self.payload_of,
                    replica_id=replica_id,
                    lease_id=lease.lease_id,
                    wall=wall,
                )
                refs.append(PromptRef.model_construct(index=i, rollout_id=rid, resume=resume))
            wire = PromptLease.model_construct(
                lease_id=lease.lease_id, deadline_s=led.loop.lease_s, prompts=refs
            )
        reply = PromptLeaseReply.model_construct(
            **self.envelope(),
            lease=wire,
            sync=led.weights.order_for(replica_id),
            init_weights=led.weights.init_allowed(),
            finished=led.finished,
            policy_step=led.policy_step,
            min_version=led.rollouts.floor(),
        )
        return reply, self._tick(led, tick)

    def submit_rollouts(
        self, replica_id: str, lease_id: str, rollouts: list[RolloutIn], *, now: float, wall: float
    ) -> tuple[SubmitReply, Tick]:
        """Record a lease's rollouts (policy replicas may submit too, under the prompt
        lease each was made for)."""
        m, led = self._ledger(replica_id, "rollout", "policy")
        self.members.touch(m, now)
        out = led.submit(replica_id, lease_id, rollouts, now=now, wall=wall)
        tick = Tick()
        if out["accepted"]:
            tick.ledger_for |= self.roles["policy"].member_ids
        if out["stale"]:  # their prompts are queued again
            tick.ledger_for |= self.roles["rollout"].member_ids
        reply = SubmitReply.model_construct(
            **self.envelope(),
            accepted=out["accepted"],
            duplicate=out["duplicate"],
            stale=out["stale"],
            unleased=out["unleased"],
            discarded=out["discarded"],
        )
        return reply, self._tick(led, tick)

    def report_episodes(
        self,
        replica_id: str,
        lease_id: str,
        progress: list[EpisodeProgress],
        *,
        now: float,
        wall: float,
    ) -> tuple[EpisodeProgressReply, Tick]:
        """A lease's holder reports its prompts' episodes so far (after each completed
        turn): kept while the lease holds them (:mod:`.ledger.episodes`). Nobody waits on
        it: no long-poll is woken."""
        m, led = self._ledger(replica_id, "rollout", "policy")
        self.members.touch(m, now)
        out = led.episodes.report(
            led.prompts, replica_id, lease_id, progress, now=now, finished=led.finished
        )
        reply = EpisodeProgressReply.model_construct(
            **self.envelope(), kept=out["kept"], unleased=out["unleased"], over_cap=out["over_cap"]
        )
        return reply, self._tick(led)

    def lease_batch(
        self,
        replica_id: str,
        step: int,
        *,
        now: float,
        wall: float,
        durable: int | None = None,
        batch: int | None = None,
    ) -> tuple[BatchLeaseReply, Tick]:
        """A policy replica asks for the rollouts of ``step`` (its committed step count).
        ``durable``: the steps it knows to be checkpointed (None: all of ``step``);
        ``batch``: a DiLoCo slot's own batch index (None: the batch of ``step``)."""
        m, led = self._ledger(replica_id, "policy")
        self.members.touch(m, now)
        discarded_before = sum(led.rollouts.discarded.values())
        end_before = (led.final_step, led.finished)
        # The asker committed ``step`` steps: batches those cover are trained even if
        # the ack was lost (the replica died between its commit and its ack), as far
        # as a checkpoint holds them: a step no checkpoint holds is not yet trained.
        led.ack(step, wall=wall, durable=durable)
        frozen = led.batch_for(step if batch is None else batch, wall=wall, own=batch is not None)
        tick = self.maybe_sync(now, wall)
        if sum(led.rollouts.discarded.values()) != discarded_before:
            tick.ledger_for |= self.roles["rollout"].member_ids
        if (led.final_step, led.finished) != end_before:  # the others' asks end too
            tick.ledger_for |= self.roles["policy"].member_ids
        reply = BatchLeaseReply.model_construct(
            **self.envelope(),
            batch=self._batch(led, frozen) if frozen is not None else None,
            sync=led.weights.order_for(replica_id),
            finished=led.finished,
            final_step=led.final_step,
        )
        return reply, self._tick(led, tick)

    def _batch(self, led: Ledger, b: dict[str, Any]) -> Batch:
        """The wire batch: each rollout's summary, with its payload from the payload
        log, or its ref in the external rollout store."""
        rollouts = []
        held = led.replay.entries  # a memory replay's entries: payloads where fresh ones are
        fresh = [(led.rollouts.records[rid], False) for rid in b["rollout_ids"]]
        for rec, replayed in fresh + [(r, True) for r in b.get("replayed", [])]:
            rid = rec["rollout_id"]
            ref: str | None = rec["ref"] if not replayed else held.get(rid, {}).get("ref")
            payload = None if ref is None or led.external_store else self._payload(ref)
            rollouts.append(
                BatchRollout.model_construct(
                    rollout_id=rid,
                    prompt=rec["prompt"],
                    version=rec["version"],
                    reward=rec["reward"],
                    exact_match=rec["exact_match"],
                    ref=ref if led.external_store else None,
                    completions=payload.completions if payload is not None else [],
                    replayed=replayed,
                )
            )
        return Batch.model_construct(
            index=b["index"],
            step=b["step"],
            frozen_at=b["frozen_at"],
            reward=b["reward"],
            exact_match=b["exact_match"],
            staleness=b["staleness"],
            rollouts=rollouts,
        )

    def _payload(self, ref: str) -> RolloutPayload | None:
        p = self.payload_of(payload_key(ref))
        if p is None or isinstance(p, RolloutPayload):
            return p
        return RolloutPayload.model_validate(p, strict=False)  # read back from disk at a restart

    def ack_batch(
        self,
        replica_id: str,
        step: int,
        *,
        now: float,
        wall: float,
        metrics: dict[str, float] | None = None,
        durable: int | None = None,
    ) -> tuple[BatchAckReply, Tick]:
        """A policy replica committed up to ``step``: weights may sync from it, and the
        batches of ``min(step, durable)`` (the steps in a checkpoint; None: all) are
        trained. The reply names the sync order it must serve, and whether the job is
        finished. ``metrics`` (what it measured on the batch) go into the history."""
        m, led = self._ledger(replica_id, "policy")
        self.members.touch(m, now)
        tick = Tick()
        end_before = (led.final_step, led.finished)
        if led.ack(step, wall=wall, metrics=metrics, durable=durable):
            tick.ledger_for |= self.roles["rollout"].member_ids
        if (led.final_step, led.finished) != end_before:
            tick.ledger_for |= self.roles["policy"].member_ids
        tick.merge(self.maybe_sync(now, wall))
        reply = BatchAckReply.model_construct(
            **self.envelope(),
            sync=led.weights.order_for(replica_id),
            finished=led.finished,
            final_step=led.final_step,
        )
        return reply, self._tick(led, tick)

    def lost_payloads(
        self, replica_id: str, lost: list[tuple[str, str]], *, now: float, wall: float
    ) -> tuple[LostReply, Tick]:
        """A policy replica could not read these rollouts' payloads."""
        m, led = self._ledger(replica_id, "policy")
        self.members.touch(m, now)
        discarded, reopened = led.lose(lost, wall=wall)
        tick = Tick()
        if discarded:
            tick.ledger_for |= self.roles["rollout"].member_ids | self.roles["policy"].member_ids
        reply = LostReply(**self.envelope(), discarded=discarded, reopened=reopened)
        return reply, self._tick(led, tick)

    def sync_poll(
        self, replica_id: str, version: int, *, now: float, wall: float
    ) -> tuple[SyncPollReply, Tick]:
        """A rollout replica between two chunks of a generation asks whether a sync
        order names it (it registered ``inflight_updates``). Cheap: no lease changes
        hands; a sync that is due may be ordered by the ask."""
        m, led = self._ledger(replica_id, "rollout")
        self.members.touch(m, now)
        if replica_id in led.weights.versions:  # not one a failed sync left out
            led.weights.versions[replica_id] = version
        tick = self.maybe_sync(now, wall)
        reply = SyncPollReply.model_construct(
            **self.envelope(), sync=led.weights.order_for(replica_id)
        )
        return reply, self._tick(led, tick)

    def sync_done(
        self,
        replica_id: str,
        seq: int,
        version: int,
        ok: bool,
        error: str = "",
        *,
        now: float,
        wall: float,
    ) -> tuple[SyncDoneReply, Tick]:
        m = self.members.member(replica_id)
        _, led = self._ledger(replica_id, m.role)
        self.members.touch(m, now)
        tick = Tick()
        if led.weights.done(replica_id, seq, version, ok, error, wall=wall):
            tick.ledger_for |= self.roles["rollout"].member_ids
            tick.merge(self.maybe_sync(now, wall))
        reply = SyncDoneReply(**self.envelope(), synced_version=led.weights.synced_version)
        return reply, self._tick(led, tick)

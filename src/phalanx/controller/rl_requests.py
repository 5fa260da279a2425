"""The RL requests of the controller's state machine: prompt leases, rollout
submissions, batch leases and acks, weight-sync reports.

A mixin of :class:`~phalanx.controller.state.ControllerState`: membership
checks and wake-ups live there, the bookkeeping in
:class:`~phalanx.controller.ledger.Ledger`. Every method takes ``now``/``wall``
and returns ``(reply, Tick)`` like the rest of the state machine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from phalanx.controller.ledger import Ledger, LedgerError
from phalanx.controller.tick import StateError, Tick

if TYPE_CHECKING:
    from phalanx.config import JobConfig
    from phalanx.controller.state import Member, RoleState


class RLRequests:
    cfg: JobConfig
    ledger: Ledger | None
    roles: dict[str, RoleState]
    members: dict[str, Member]

    def member(self, replica_id: str, field: str = "replica_id") -> Member:
        raise NotImplementedError  # provided by ControllerState

    def _ledger(self, replica_id: str, *roles: str) -> tuple[Member, Ledger]:
        if self.ledger is None:
            raise StateError(
                "this job has no RL ledger: the controller's config has no [rl] section. "
                "Start the controller with the RL job's TOML.",
            )
        m = self.member(replica_id)
        if m.role not in roles:
            want = " or ".join(repr(r) for r in roles)
            raise StateError(
                f"replica {replica_id!r} must have role {want} for this request: got {m.role!r}.",
                field="replica_id",
            )
        return m, self.ledger

    def _leader(self) -> tuple[str, str] | None:
        """The policy leader (rank 0 of the newest policy quorum), if still a member."""
        q = self.roles["policy"].last_quorum
        if q is None or not q.members or q.members[0].replica_id not in self.members:
            return None
        return q.members[0].replica_id, q.members[0].address

    def _maybe_sync(self, now: float, wall: float) -> Tick:
        assert self.ledger is not None
        order = self.ledger.maybe_sync(
            self._leader(), self.roles["rollout"].member_ids, now=now, wall=wall
        )
        return Tick(ledger_for=set(order.members)) if order is not None else Tick()

    def _ledger_call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except LedgerError as e:
            err = StateError(str(e), field=e.field)
            err.status = e.status
            raise err from None

    def lease_prompts(
        self, replica_id: str, version: int, max_prompts: int, *, now: float, wall: float
    ) -> tuple[dict[str, Any], Tick]:
        """A rollout replica asks for prompts. The reply carries the lease (or None),
        the sync order it must take part in first (or None), and the job's state."""
        m, led = self._ledger(replica_id, "rollout")
        m.last_seen = now
        led.versions[replica_id] = version  # before deciding whether anyone needs a sync
        tick = self._maybe_sync(now, wall)
        lease = led.lease(replica_id, version, max_prompts, now=now, wall=wall)
        reply = {
            "lease": None,
            "sync": led.sync_for(replica_id),
            "init_weights": led.init_allowed(),
            "finished": led.finished,
            "policy_step": led.policy_step,
            "min_version": led._floor(),
        }
        if lease is not None:
            reply["lease"] = {
                "lease_id": lease.lease_id,
                "deadline_s": self.cfg.rl.loop.lease_s if self.cfg.rl else 0.0,
                "prompts": [
                    {"index": i, "rollout_id": led.prompts[i].rollout_id} for i in lease.prompts
                ],
            }
        return reply, tick

    def submit_rollouts(
        self,
        replica_id: str,
        lease_id: str,
        rollouts: list[dict[str, Any]],
        *,
        now: float,
        wall: float,
    ) -> tuple[dict[str, Any], Tick]:
        # Policy replicas submit too: the rollouts they drained from a rollout queue
        # (rl.transport.rollouts), under the prompt lease each was made for.
        m, led = self._ledger(replica_id, "rollout", "policy")
        m.last_seen = now
        out = self._ledger_call(led.submit, replica_id, lease_id, rollouts, now=now, wall=wall)
        tick = Tick()
        if out["accepted"]:
            tick.ledger_for |= self.roles["policy"].member_ids
        if out["stale"]:
            tick.ledger_for |= self.roles["rollout"].member_ids
        return out, tick

    def lease_batch(
        self, replica_id: str, step: int, *, now: float, wall: float
    ) -> tuple[dict[str, Any], Tick]:
        """A policy replica asks for the rollouts of ``step`` (its committed step count)."""
        m, led = self._ledger(replica_id, "policy")
        m.last_seen = now
        discarded_before = sum(led.discarded.values())
        # The asker committed ``step`` steps: batches those cover are trained even if
        # the ack was lost (the replica died between its commit and its ack).
        if step > 0:
            led.ack(step, wall=wall)
        batch = led.batch_for(step, wall=wall)
        tick = self._maybe_sync(now, wall)
        if sum(led.discarded.values()) != discarded_before:
            tick.ledger_for |= self.roles["rollout"].member_ids
        reply: dict[str, Any] = {
            "batch": None,
            "sync": led.sync_for(replica_id),
            "finished": led.finished,
        }
        if batch is not None:
            reply["batch"] = {
                **{k: v for k, v in batch.items() if k != "rollout_ids"},
                "rollouts": [led.rollouts[rid] for rid in batch["rollout_ids"]],
            }
        return reply, tick

    def ack_batch(
        self, replica_id: str, step: int, *, now: float, wall: float
    ) -> tuple[dict[str, Any], Tick]:
        """A policy replica committed up to ``step``: its batches are trained."""
        m, led = self._ledger(replica_id, "policy")
        m.last_seen = now
        tick = Tick()
        if led.ack(step, wall=wall):
            tick.ledger_for |= self.roles["rollout"].member_ids
            if led.finished:
                tick.ledger_for |= self.roles["policy"].member_ids
        tick.merge(self._maybe_sync(now, wall))
        return {"sync": led.sync_for(replica_id), "finished": led.finished}, tick

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
    ) -> tuple[dict[str, Any], Tick]:
        m = self.member(replica_id)
        if self.ledger is None:
            self._ledger(replica_id, m.role)
        assert self.ledger is not None
        m.last_seen = now
        tick = Tick()
        if self.ledger.sync_done(replica_id, seq, version, ok, error, wall=wall):
            tick.ledger_for |= self.roles["rollout"].member_ids
            tick.merge(self._maybe_sync(now, wall))
        return {"synced_version": self.ledger.synced_version}, tick

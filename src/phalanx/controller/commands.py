"""Command queues, the operator's actions, and the checkpoint records.

A mixin of :class:`~phalanx.controller.state.ControllerState`. The operator
acts through the dashboard and the CLI: ``phalanx scale`` records a desired
replica count, evict removes a member at once, and drain and the checkpoint
trigger are commands queued for the replicas, which poll and acknowledge
them at their step boundaries (:mod:`phalanx.train.orders`). A checkpoint,
triggered or scheduled, ends in a record that its saver reports
(:meth:`CommandQueues.record_checkpoint`).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from phalanx.controller.records import Command, StateRecords
from phalanx.controller.tick import Conflict, Tick

CHECKPOINT_HISTORY = 20
"""Committed checkpoints kept in the records (and the status), newest last."""


class CommandQueues(StateRecords):
    # -- commands --------------------------------------------------------

    def enqueue(
        self, target: str, kind: str, payload: dict[str, Any], *, now: float, wall: float
    ) -> tuple[list[Command], Tick]:
        """Queue a command for one replica (by id) or every member of a role (by name)."""
        if target in self.roles:
            ids = sorted(m.replica_id for m in self.alive(target))
        else:
            ids = [self.member(target, field="target").replica_id]
        out = []
        for rid in ids:
            self.command_seq += 1
            c = Command(self.command_seq, rid, kind, dict(payload), wall)
            self.commands.setdefault(rid, {})[c.id] = c
            self._put("commands", f"{c.id:012d}", asdict(c))
            out.append(c)
        self._put("meta", "command_seq", {"value": self.command_seq})
        return out, Tick(commands_for=set(ids))

    def pending_commands(self, replica_id: str, after: int = 0) -> list[Command]:
        self.member(replica_id)
        q = self.commands.get(replica_id, {})
        return [q[cid] for cid in sorted(q) if cid > after]

    def ack(self, replica_id: str, command_ids: list[int]) -> list[int]:
        """Acknowledge commands; returns the ids that were not pending (already acked)."""
        self.member(replica_id)
        q = self.commands.get(replica_id, {})
        missing = []
        for cid in command_ids:
            if q.pop(cid, None) is None:
                missing.append(cid)
            else:
                self._put("commands", f"{cid:012d}", None)
        return missing

    # -- operator actions (the dashboard, the CLI) -----------------------

    def set_desired(self, role: str, replicas: int, *, now: float, wall: float) -> dict[str, int]:
        """Record the replica count an operator wants for ``role``."""
        self._role(role)
        self.desired[role] = replicas
        self._put("meta", f"desired/{role}", {"value": replicas})
        self._event("scale", wall, role=role, replicas=replicas)
        return dict(self.desired)

    def evict_replica(self, replica_id: str, reason: str = "", *, now: float, wall: float) -> Tick:
        """An operator evicts a replica. The process, if alive, gets 410 at its next
        call and registers again as a new incarnation."""
        self.member(replica_id)
        return self._evict(
            replica_id, f"evicted by operator: {reason or 'no reason given'}", now, wall
        )

    def drain_replica(
        self, replica_id: str, *, now: float, wall: float
    ) -> tuple[list[Command], Tick]:
        """Ask a replica to leave at its next step boundary (a ``drain`` command)."""
        cmds, tick = self.enqueue(replica_id, "drain", {}, now=now, wall=wall)
        self._event("drain", wall, role=self.members[replica_id].role, replica_id=replica_id)
        return cmds, tick

    def request_checkpoint(
        self, lead: int, *, now: float, wall: float
    ) -> tuple[list[Command], Tick]:
        """Ask the policy replicas to checkpoint the step ``lead`` steps from the
        role's current one: the same step on every replica, far enough ahead that
        each has polled its commands by then."""
        rs = self._role("policy")
        if not self.cfg.checkpoint.url:
            raise Conflict(
                "checkpoint.url must be set to trigger a checkpoint: got none. Set "
                "[checkpoint] url in the job config."
            )
        step = rs.step + max(1, lead)
        cmds, tick = self.enqueue("policy", "checkpoint", {"step": step}, now=now, wall=wall)
        self._event("checkpoint_requested", wall, role="policy", step=step, replicas=len(cmds))
        return cmds, tick

    # -- checkpoints -----------------------------------------------------

    def record_checkpoint(
        self, replica_id: str, step: int, url: str, nbytes: int, *, now: float, wall: float
    ) -> dict[str, Any]:
        """A replica committed a checkpoint of ``step`` at ``url``: remember it
        (the job's latest restorable step is in the status)."""
        m = self.member(replica_id)
        # The saver knows its step committed before the controller does (it learns
        # of commits from the next quorum request or heartbeat).
        self._bump_step(self.roles[m.role], step, now)
        rec = {
            "step": step,
            "url": url,
            "nbytes": nbytes,
            "by": replica_id,
            "role": m.role,
            "at": wall,
        }
        self.checkpoints = sorted(
            [c for c in self.checkpoints if c["step"] != step] + [rec], key=lambda c: c["step"]
        )
        self._put("checkpoints", f"{step:012d}", rec)
        while len(self.checkpoints) > CHECKPOINT_HISTORY:
            old = self.checkpoints.pop(0)
            self._put("checkpoints", f"{old['step']:012d}", None)
        self._event("checkpoint", wall, replica_id=replica_id, step=step, url=url, nbytes=nbytes)
        return rec

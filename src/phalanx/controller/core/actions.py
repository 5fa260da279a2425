"""Commands and the operator's actions: what ``phalanx scale``, ``evict``, ``drain``
and ``checkpoint`` do to the controller's state, and the commands replicas poll.

A part of :class:`~.state.ControllerState` (it inherits these), kept apart because
it only orchestrates the other parts: it queues commands, records the operator's
wishes and evicts through the state's own ``_evict``. Pure like the rest of the
core: no I/O, ``now`` and ``wall`` passed in.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from phalanx.controller.core.base import ChangeLog, Conflict, Tick
from phalanx.controller.core.records import Member, RoleState, save_role
from phalanx.protocol.commands import CheckpointRecord, Command

if TYPE_CHECKING:
    from phalanx.config import JobConfig
    from phalanx.controller.core.commands import CheckpointBook, Commands
    from phalanx.controller.core.membership import Membership


class OperatorActions:
    """The commands and operator actions of :class:`~.state.ControllerState`."""

    cfg: JobConfig
    log: ChangeLog
    roles: dict[str, RoleState]
    membership: Membership
    commands: Commands
    checkpoints: CheckpointBook
    desired: dict[str, int]
    members: Any

    if TYPE_CHECKING:  # ControllerState's own, which these actions go through

        def member(self, replica_id: str, field: str = "replica_id") -> Member: ...

        def alive(self, role: str) -> list[Member]: ...

        def _evict(self, replica_id: str, reason: str, now: float, wall: float) -> Tick: ...

    def enqueue(
        self, target: str, kind: str, payload: dict[str, Any], *, now: float, wall: float
    ) -> tuple[list[Command], Tick]:
        """Queue a command for one replica (by id) or every member of a role (by name)."""
        if target in self.roles:
            ids = [m.replica_id for m in self.alive(target)]
        else:
            ids = [self.member(target, field="target").replica_id]
        return self.commands.enqueue(ids, kind, payload, wall), Tick(commands_for=set(ids))

    def pending_commands(self, replica_id: str, after: int = 0) -> list[Command]:
        self.member(replica_id)
        return self.commands.pending(replica_id, after)

    def ack(self, replica_id: str, command_ids: list[int]) -> list[int]:
        """Acknowledge commands; returns the ids that were not pending (already acked)."""
        self.member(replica_id)
        return self.commands.ack(replica_id, command_ids)

    def set_desired(self, role: str, replicas: int, *, now: float, wall: float) -> dict[str, int]:
        """Record the replica count an operator wants for ``role``."""
        self.membership.role(role)
        self.desired[role] = replicas
        self.log.put("meta", f"desired/{role}", {"value": replicas})
        self.log.event("scale", wall, role=role, replicas=replicas)
        return dict(self.desired)

    def evict_replica(self, replica_id: str, reason: str = "", *, now: float, wall: float) -> Tick:
        """An operator evicts a replica. The process, if alive, gets 410 at its next
        call and registers again as a new incarnation."""
        self.member(replica_id)
        why = f"evicted by operator: {reason or 'no reason given'}"
        return self._evict(replica_id, why, now, wall)

    def drain_replica(
        self, replica_id: str, *, now: float, wall: float
    ) -> tuple[list[Command], Tick]:
        """Ask a replica to leave at its next step boundary (a ``drain`` command)."""
        cmds, tick = self.enqueue(replica_id, "drain", {}, now=now, wall=wall)
        self.log.event("drain", wall, role=self.members[replica_id].role, replica_id=replica_id)
        return cmds, tick

    def request_checkpoint(
        self, lead: int, *, now: float, wall: float
    ) -> tuple[list[Command], Tick]:
        """Ask the policy replicas to checkpoint the step ``lead`` steps from the
        role's current one: the same step on every replica, far enough ahead that
        each has polled its commands by then."""
        rs = self.membership.role("policy")
        if not self.cfg.checkpoint.url:
            raise Conflict(
                "checkpoint.url must be set to trigger a checkpoint: got none. Set "
                "[checkpoint] url in the job config."
            )
        step = rs.step + max(1, lead)
        cmds, tick = self.enqueue("policy", "checkpoint", {"step": step}, now=now, wall=wall)
        self.log.event("checkpoint_requested", wall, role="policy", step=step, replicas=len(cmds))
        return cmds, tick

    def record_checkpoint(
        self, replica_id: str, step: int, url: str, nbytes: int, *, now: float, wall: float
    ) -> CheckpointRecord:
        """A replica committed a checkpoint of ``step`` at ``url``: remember it (the
        job's latest restorable step is in the status)."""
        m = self.member(replica_id)
        # The saver knows its step committed before the controller does (it learns
        # of commits from the next quorum request or heartbeat).
        rs = self.roles[m.role]
        if rs.bump_step(step, now):
            save_role(self.log, rs)
        return self.checkpoints.record(replica_id, m.role, step, url, nbytes, wall)

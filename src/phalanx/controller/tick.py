"""What a state-machine call hands back besides its reply: the refusals it may
raise, and the :class:`Tick` of waiters the server must wake."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phalanx.controller.records import Quorum


class StateError(Exception):
    """A request the state machine refuses. ``status`` is the HTTP status to use."""

    status = 400

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class UnknownReplica(StateError):
    """The replica id is not a member: never registered, or evicted (gone for good)."""

    status = 410


class Conflict(StateError):
    status = 409


@dataclass
class Tick:
    """What a call changed that the server must act on (wake waiters)."""

    formed: list[Quorum] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    probe: list[str] = field(default_factory=list)
    commands_for: set[str] = field(default_factory=set)
    ledger_for: set[str] = field(default_factory=set)
    """Replicas whose ledger long-poll (prompt or batch lease) may now have an answer."""
    queues: set[str] = field(default_factory=set)
    """Rollout queues (by name) whose lease long-polls may now have an answer."""

    def merge(self, other: Tick) -> Tick:
        self.formed += other.formed
        self.evicted += other.evicted
        self.probe += other.probe
        self.commands_for |= other.commands_for
        self.ledger_for |= other.ledger_for
        self.queues |= other.queues
        return self

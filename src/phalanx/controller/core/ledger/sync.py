"""Weight-sync orders: when policy weights move to the rollout replicas, and who
takes part.

A weights **version** is the policy's committed step count. After every
``sync_every`` commits the ledger orders a sync: the policy leader broadcasts
its newest snapshot to every idle rollout replica that is behind (the mesh).
At most one sync is in flight; a mesh change (join, eviction, new leader)
makes the next sync rebuild the group (``mesh_id`` changes) and brings
joiners up to date before they may lease prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from phalanx.controller.core.base import ChangeLog
from phalanx.protocol.rl import SyncOrder


@dataclass
class Sync:
    seq: int
    mesh_id: int
    members: list[str]
    """Policy leader first, then the rollout replicas (rank = position)."""
    store: str
    """The leader's rendezvous address."""
    ordered_at: float
    ordered_mono: float = field(default=0.0, compare=False)
    done: dict[str, int] = field(default_factory=dict)
    """Members that finished, with the version they now hold."""

    def record(self) -> dict[str, Any]:
        d = asdict(self)
        del d["ordered_mono"]
        return d


class WeightSync:
    def __init__(self, log: ChangeLog, save: Callable[[], None], timeout_s: float):
        self.log, self.save, self.timeout_s = log, save, timeout_s
        self.want_version = 0
        self.synced_version = 0
        """Newest version a completed sync delivered (0: the init weights, from config)."""
        self.sync: Sync | None = None
        self.sync_seq = 0
        self.mesh_id = 0
        self.mesh: list[str] = []
        self.source_busy: tuple[str, int] | None = None
        """(leader, seq) of the last order until the leader reports it (not durable)."""
        self.versions: dict[str, int] = {}
        """Weights version each rollout replica last declared (not durable)."""

    def meta(self) -> dict[str, Any]:
        return {
            "want_version": self.want_version,
            "synced_version": self.synced_version,
            "sync_seq": self.sync_seq,
            "mesh_id": self.mesh_id,
            "mesh": self.mesh,
        }

    def restore(self, meta: dict[str, Any]) -> None:
        # An in-flight sync is not restored: its members either finished it or
        # will fail it; the next order rebuilds from the journaled mesh.
        for k in ("want_version", "synced_version", "sync_seq", "mesh_id", "mesh"):
            setattr(self, k, meta[k])

    def init_allowed(self) -> bool:
        """Whether a replica with no weights may build version 0 from config itself."""
        return self.synced_version == 0 and self.want_version == 0

    def committed(self, step: int, sync_every: int) -> None:
        """The policy committed up to ``step``: every ``sync_every`` steps is wanted."""
        self.want_version = max(self.want_version, step - step % sync_every)

    def rewind(self, step: int) -> None:
        self.want_version = min(self.want_version, step)
        self.synced_version = min(self.synced_version, step)

    def maybe_sync(
        self,
        leader: tuple[str, str] | None,
        rollout_ids: Iterable[str],
        busy: set[str],
        *,
        finished: bool,
        now: float,
        wall: float,
    ) -> Sync | None:
        """Order a sync if none is in flight and an idle rollout replica needs newer
        weights (a commit reached ``want_version``, or a joiner has none). The mesh is
        the leader and those replicas. ``leader`` is the policy leader's (replica id,
        rendezvous address); ``busy`` the replicas holding a prompt lease. Returns
        the new order."""
        if self.sync is not None:
            if now - self.sync.ordered_mono > self.timeout_s:
                self.fail("timed out", wall)
            else:
                return None
        if leader is not None and self.source_busy is not None:
            if self.source_busy[0] == leader[0]:
                return None  # the leader still sends (or times out) the previous one
            self.source_busy = None  # that leader is gone
        rollouts = sorted(rollout_ids)
        if finished or leader is None or not rollouts or self.init_allowed():
            return None  # nothing newer than the init weights every replica can build
        target = max(self.want_version, self.synced_version)
        # Only replicas between two generation batches (holding no lease) take part:
        # a broadcast waits for its slowest member, and one replica busy generating
        # must not hold back the weights of all the others (nor the policy, which
        # waits for fresh rollouts). A busy one joins the next sync.
        # And only replicas that asked for prompts since they (re)started or failed a
        # sync: one still loading its model would hold the broadcast until it times out.
        behind = [r for r in rollouts if r not in busy and self.versions.get(r, target) < target]
        if not behind:
            return None
        members = [leader[0], *behind]
        if members != self.mesh:
            self.mesh_id += 1
            self.mesh = members
        self.sync_seq += 1
        self.sync = Sync(self.sync_seq, self.mesh_id, members, leader[1], wall, now)
        self.source_busy = (leader[0], self.sync_seq)
        self.save()
        self.log.event(
            "sync_ordered",
            wall,
            seq=self.sync_seq,
            mesh_id=self.mesh_id,
            members=len(members),
            want_version=self.want_version,
        )
        return self.sync

    def fail(self, reason: str, wall: float) -> None:
        s = self.sync
        if s is None:
            return
        self.log.event("sync_failed", wall, seq=s.seq, reason=reason)
        # Members that have not reported may still be inside the failed broadcast: leave
        # them out of the next order until they ask for prompts again (declaring their
        # version), or they would stall it in turn.
        for rid in s.members[1:]:
            if rid not in s.done:
                self.versions.pop(rid, None)
        self.sync = None
        self.mesh = []  # rebuild the group: some member's communicator is broken
        # Journaled: a restart must not revive the broken mesh (and reuse its mesh_id).
        self.save()

    def drop_member(self, replica_id: str, wall: float) -> None:
        """A replica left: an in-flight sync that counts on it is abandoned."""
        self.versions.pop(replica_id, None)
        if self.sync is not None and replica_id in self.sync.members:
            self.fail(f"member {replica_id} gone", wall)

    def done(
        self, replica_id: str, seq: int, version: int, ok: bool, error: str, *, wall: float
    ) -> bool:
        """A mesh member finished sync ``seq`` (``ok``) or failed it. True when the sync
        completed or failed as a whole (the caller may order the next one)."""
        freed = self.source_busy == (replica_id, seq)
        if freed:
            self.source_busy = None  # the leader's sender is free for the next order
        s = self.sync
        if s is None or s.seq != seq or replica_id not in s.members:
            return freed  # an old or abandoned sync: only a freed leader is news
        if not ok:
            self.fail(f"{replica_id}: {error[:200]}", wall)
            return True
        s.done[replica_id] = version
        if replica_id != s.members[0]:  # versions are the rollout replicas'
            self.versions[replica_id] = version
        if len(s.done) < len(s.members):
            return False
        v = min(s.done.values())
        self.synced_version = max(self.synced_version, v)
        self.log.event("sync_done", wall, seq=s.seq, version=v, members=len(s.members))
        self.sync = None
        self.save()
        return True

    def order_for(self, replica_id: str) -> SyncOrder | None:
        """The in-flight sync order, if ``replica_id`` must take part and has not yet."""
        s = self.sync
        if s is None or replica_id not in s.members or replica_id in s.done:
            return None
        return SyncOrder.model_construct(
            seq=s.seq,
            mesh_id=s.mesh_id,
            members=tuple(s.members),
            rank=s.members.index(replica_id),
            store=s.store,
        )

    def status(self) -> dict[str, Any]:
        return {
            "want_version": self.want_version,
            "synced_version": self.synced_version,
            "mesh_id": self.mesh_id,
            "sync_in_flight": self.sync.record() if self.sync else None,
            "versions": dict(sorted(self.versions.items())),
        }

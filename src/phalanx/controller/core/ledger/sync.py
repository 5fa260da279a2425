"""Weight-sync orders: when policy weights move to the rollout replicas, and who
takes part.

A weights **version** is the policy's committed step count. After every
``sync_every`` commits the ledger orders a sync: the policy leader broadcasts
its newest snapshot to every idle rollout replica that is behind (the mesh).
At most one sync is in flight; a mesh change (join, eviction, new leader)
makes the next sync rebuild the group (``mesh_id`` changes) and brings
joiners up to date before they may lease prompts.

**The source** is rank 0 of the mesh. When an idle rollout replica already
holds the version the others need and can relay it (it said so when it
registered: the collective channel keeps what it fetched), it is the source,
not the policy leader, which goes on training undisturbed: a late joiner gets
its weights from a rollout peer (Cosmos-RL's rollout-to-rollout broadcast).

**The first mesh** waits for the rollout role's ``n_init_replicas`` to be up
(asking for prompts), for up to ``hold_s``: the first replica generates with
the init weights meanwhile, and the group is built once for all of them
instead of once per replica as they come up. After ``hold_s`` it goes ahead
with those that are up (event ``sync_short``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from phalanx.controller.core.base import ChangeLog
from phalanx.protocol.rl import SyncOrder


@dataclass
class Sync:
    seq: int
    mesh_id: int
    members: list[str]
    """The source first (the policy leader or a rollout peer), then the rollout
    replicas that receive (rank = position)."""
    store: str
    """The source's rendezvous address."""
    ordered_at: float
    ordered_mono: float = field(default=0.0, compare=False)
    source_role: str = "policy"
    """``policy`` (the leader sends) or ``rollout`` (a peer relays what it holds)."""
    done: dict[str, int] = field(default_factory=dict)
    """Members that finished, with the version they now hold."""
    handed: bool = field(default=False, compare=False)
    """Whether the order went out to its source (in a reply to it)."""
    published_at: float = field(default=0.0, compare=False)
    """When the version it sends was committed (wall clock; 0: not known, as after a
    controller restart): the start of its ``sync_effect_s``."""

    def record(self) -> dict[str, Any]:
        d = asdict(self)
        del d["ordered_mono"], d["handed"], d["published_at"]
        return d


class WeightSync:
    def __init__(
        self, log: ChangeLog, save: Callable[[], None], timeout_s: float, hold_s: float = 0.0
    ):
        self.log, self.save, self.timeout_s = log, save, timeout_s
        self.hold_s = hold_s
        """How long the first mesh waits for the rollout role's n_init_replicas."""
        self.want_version = 0
        self.synced_version = 0
        """Newest version a completed sync delivered (0: the init weights, from config)."""
        self.sync: Sync | None = None
        self.sync_seq = 0
        self.mesh_id = 0
        self.mesh: list[str] = []
        self.source_busy: tuple[str, int] | None = None
        """(source, seq) of the last order until its source reports it (not durable).
        No deadline: a source's send may take far longer than the sync timeout (its
        connections' setup under loss), and a second order would queue behind it."""
        self.first_wanted: float | None = None
        """When the first mesh was first wanted (monotonic; not durable)."""
        self.versions: dict[str, int] = {}
        """Weights version each rollout replica last declared (not durable)."""
        self.wanted_at = 0.0
        """When ``want_version`` took its value (wall clock; not durable): when that
        version was published to the rollout replicas, whether or not a sync could be
        ordered at once."""

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

    def committed(self, step: int, sync_every: int, wall: float = 0.0) -> None:
        """The policy committed up to ``step``: every ``sync_every`` steps is wanted."""
        want = max(self.want_version, step - step % sync_every)
        if want != self.want_version:
            self.want_version, self.wanted_at = want, wall

    def rewind(self, step: int) -> None:
        self.want_version = min(self.want_version, step)
        self.synced_version = min(self.synced_version, step)

    def maybe_sync(
        self,
        leader: tuple[str, str] | None,
        rollout_ids: Iterable[str],
        busy: set[str],
        *,
        inflight: Iterable[str] = (),
        relays: Mapping[str, str] | None = None,
        n_init: int = 1,
        finished: bool,
        now: float,
        wall: float,
    ) -> Sync | None:
        """Order a sync if none is in flight and an idle rollout replica needs newer
        weights (a commit reached ``want_version``, or a joiner has none). The mesh is
        the source and those replicas. ``leader`` is the policy leader's (replica id,
        rendezvous address); ``busy`` the replicas holding a prompt lease; ``inflight``
        those among them that take a sync in the middle of a generation; ``relays``
        the rollout replicas that can relay what they hold (id -> address);
        ``n_init`` the rollout replicas the first mesh waits for. Returns the new order."""
        if self.sync is not None:
            if now - self.sync.ordered_mono > self.timeout_s:
                self.fail("timed out", wall)
            else:
                return None
        rollouts = sorted(rollout_ids)
        if self.source_busy is not None and self.source_busy[0] not in (
            leader[0] if leader else None,
            *rollouts,
        ):
            self.source_busy = None  # that source is gone
        if finished or not rollouts or self.init_allowed():
            return None  # nothing newer than the init weights every replica can build
        # With no policy leader (it is down, or restarting), nothing newer than what a
        # rollout peer holds and can relay may be sent: a joiner may still get that. (A
        # peer may hold a newer version than the last completed sync: one whose source
        # died before it reported, after the peer had it.)
        if leader:
            target = max(self.want_version, self.synced_version)
        else:
            held = [self.versions.get(r, 0) for r in rollouts if r in (relays or {})]
            target = max([self.synced_version, *held])
        # Only replicas between two generation batches (holding no lease) take part:
        # a broadcast waits for its slowest member, and one replica busy generating
        # must not hold back the weights of all the others (nor the policy, which
        # waits for fresh rollouts). A busy one joins the next sync, unless it takes
        # updates in flight (capability ``inflight_updates``): it polls for orders
        # between chunks of its generation and joins within one chunk's time.
        # And only replicas that asked for prompts since they (re)started or failed a
        # sync: one still loading its model would hold the broadcast until it times out.
        takes = busy - set(inflight)
        behind = [r for r in rollouts if r not in takes and self.versions.get(r, target) < target]
        if not behind or self._hold_first(rollouts, n_init, now, wall):
            return None
        source = self._source(leader, rollouts, busy, relays or {}, target)
        if source is None:
            return None  # the only possible source still sends (or times out) the last one
        members = [source[0], *behind]
        if members != self.mesh:
            self.mesh_id += 1
            self.mesh = members
        self.sync_seq += 1
        role = "policy" if leader is not None and source[0] == leader[0] else "rollout"
        self.sync = Sync(self.sync_seq, self.mesh_id, members, source[1], wall, now, role)
        if target == self.want_version:
            self.sync.published_at = self.wanted_at
        self.source_busy = (source[0], self.sync_seq)
        self.save()
        self.log.event(
            "sync_ordered",
            wall,
            seq=self.sync_seq,
            mesh_id=self.mesh_id,
            members=len(members),
            want_version=self.want_version,
            source=source[0],
            source_role=role,
        )
        return self.sync

    def _hold_first(self, rollouts: list[str], n_init: int, now: float, wall: float) -> bool:
        """Whether the first mesh still waits for ``n_init`` rollout replicas to be up."""
        if self.mesh_id > 0:
            return False
        up = sum(1 for r in rollouts if r in self.versions)
        if up >= n_init:
            return False
        if self.first_wanted is None:
            self.first_wanted = now
        if now - self.first_wanted < self.hold_s:
            return True
        self.log.event("sync_short", wall, up=up, n_init=n_init, waited_s=round(self.hold_s, 3))
        return False

    def _source(
        self,
        leader: tuple[str, str] | None,
        rollouts: list[str],
        busy: set[str],
        relays: Mapping[str, str],
        target: int,
    ) -> tuple[str, str] | None:
        """An idle rollout peer that holds ``target`` and relays, else the policy leader
        (None: neither, or the leader still sends its previous order)."""
        sending = self.source_busy[0] if self.source_busy else None
        for r in rollouts if target > 0 else ():  # version 0 was built from config: no copy
            if r in relays and r not in busy and r != sending and self.versions.get(r) == target:
                return r, relays[r]
        return None if leader is None or sending == leader[0] else leader

    def fail(self, reason: str, wall: float) -> None:
        s = self.sync
        if s is None:
            return
        self.log.event("sync_failed", wall, seq=s.seq, reason=reason)
        if not s.handed and self.source_busy == (s.members[0], s.seq):
            # The source never got this order (it asks only between its own steps,
            # and a member failed the sync first): it will never report it.
            self.source_busy = None
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
        s = self.sync
        if s is not None and replica_id == s.members[0] and set(s.members[1:]) <= set(s.done):
            # The source left after every receiver had the weights (only its own
            # report was missing): the sync did its work.
            self._completed(s, wall)
        elif s is not None and replica_id in s.members:
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
        if replica_id != s.members[0]:  # a source's version did not change
            self.versions[replica_id] = version
        if len(s.done) < len(s.members):
            return False
        self._completed(s, wall)
        return True

    def _completed(self, s: Sync, wall: float) -> None:
        v = min(
            (v for rid, v in s.done.items() if rid != s.members[0]), default=self.synced_version
        )
        self.synced_version = max(self.synced_version, v)
        self.log.event(
            "sync_done",
            wall,
            seq=s.seq,
            version=v,
            members=len(s.members),
            source=s.members[0],
            source_role=s.source_role,
        )
        self.sync = None
        self.save()

    def order_for(self, replica_id: str) -> SyncOrder | None:
        """The in-flight sync order, if ``replica_id`` must take part and has not yet."""
        s = self.sync
        if s is None or replica_id not in s.members or replica_id in s.done:
            return None
        if replica_id == s.members[0]:
            s.handed = True  # the caller's reply carries it
        return SyncOrder.model_construct(
            seq=s.seq,
            mesh_id=s.mesh_id,
            members=tuple(s.members),
            rank=s.members.index(replica_id),
            store=s.store,
            ordered_at=s.ordered_at,
            published_at=s.published_at or s.ordered_at,
        )

    def status(self) -> dict[str, Any]:
        return {
            "want_version": self.want_version,
            "synced_version": self.synced_version,
            "mesh_id": self.mesh_id,
            "sync_in_flight": self.sync.record() if self.sync else None,
            "versions": dict(sorted(self.versions.items())),
        }

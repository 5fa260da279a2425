"""Prompt dispatch: the cursor, prompts in flight, and the leases that hold them.

A **prompt** is an index into the task's prompt stream; the ledger owns the
cursor. A rollout replica *leases* a few prompts with a deadline; a prompt
whose lease ends unsubmitted (deadline passed, holder gone) goes back to the
front of the queue, under the same attempt, so that a late submission of it
is recognised as a duplicate by rollout id.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from phalanx.controller.core.base import ChangeLog
from phalanx.protocol.rl import rollout_id


@dataclass
class Lease:
    lease_id: str
    replica_id: str
    prompts: list[int]
    version: int
    issued_at: float
    deadline: float = field(default=0.0, compare=False)
    """Monotonic; not durable (a restored lease gets a fresh deadline)."""

    def record(self) -> dict[str, Any]:
        d = asdict(self)
        del d["deadline"]
        return d


@dataclass
class Prompt:
    index: int
    attempt: int = 0
    state: str = "queued"
    """queued | leased | done (a rollout is pending or batched)."""
    lease_id: str | None = None
    held_by: list[str] | None = None
    """The leases that held this attempt, as ``"<lease id> <replica id>"`` (the last
    :data:`HELD_BY`): a late submission under one of them is the holder's own. None in a
    record journaled before leases were checked (its submissions are taken on trust)."""

    @property
    def rollout_id(self) -> str:
        return rollout_id(self.index, self.attempt)


HELD_BY = 16
"""Leases remembered per prompt attempt (a prompt leased again and again, its holders
dying each time, keeps the last ones)."""


class PromptBook:
    def __init__(
        self, log: ChangeLog, counts: dict[str, int], save: Callable[[], None], lease_s: float
    ):
        self.log, self.counts, self.save, self.lease_s = log, counts, save, lease_s
        self.cursor = 0
        self.by_index: dict[int, Prompt] = {}
        self.requeue: deque[int] = deque()
        self.leases: dict[str, Lease] = {}
        self.lease_seq = 0

    def meta(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "lease_seq": self.lease_seq, "requeue": list(self.requeue)}

    def restore(
        self, meta: dict[str, Any], tables: dict[str, dict[str, dict[str, Any]]], now: float
    ) -> None:
        self.cursor, self.lease_seq = meta["cursor"], meta["lease_seq"]
        self.requeue = deque(meta["requeue"])
        for rec in tables.get("prompts", {}).values():
            self.by_index[rec["index"]] = Prompt(**rec)
        for rec in tables.get("leases", {}).values():
            self.leases[rec["lease_id"]] = Lease(**rec, deadline=now + self.lease_s)

    def _save_prompt(self, p: Prompt) -> None:
        self.log.put("prompts", str(p.index), asdict(p))

    def states(self) -> dict[str, int]:
        out = {"queued": 0, "leased": 0, "done": 0}
        for p in self.by_index.values():
            out[p.state] += 1
        return out

    def outstanding(self) -> int:
        """Prompts issued and not yet done (queued or leased)."""
        return sum(1 for p in self.by_index.values() if p.state != "done")

    def busy(self) -> set[str]:
        """Replicas holding a lease (generating)."""
        return {le.replica_id for le in self.leases.values()}

    def leased_by(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for le in self.leases.values():
            out[le.replica_id] = out.get(le.replica_id, 0) + len(le.prompts)
        return dict(sorted(out.items()))

    # -- leases ----------------------------------------------------------

    def lease(
        self, replica_id: str, version: int, max_prompts: int, room: int, *, now: float, wall: float
    ) -> Lease | None:
        """Lease prompts dispatched again first (whatever the backpressure: they are
        already outstanding, so holding them back could only stall), then up to
        ``room`` new ones from the cursor."""
        idx: list[int] = []
        popped = bool(self.requeue)
        while self.requeue and len(idx) < max_prompts:
            i = self.requeue.popleft()
            p = self.by_index.get(i)
            if p is not None and p.state == "queued" and i not in idx:
                idx.append(i)
        for _ in range(min(max_prompts - len(idx), room)):
            idx.append(self.cursor)
            self.by_index[self.cursor] = Prompt(self.cursor, held_by=[])
            self.cursor += 1
        if not idx:
            if popped:  # dropped entries of prompts no longer queued: journal that
                self.save()
            return None
        self.lease_seq += 1
        lease = Lease(f"L{self.lease_seq}", replica_id, idx, version, wall, now + self.lease_s)
        self.leases[lease.lease_id] = lease
        for i in idx:
            p = self.by_index[i]
            p.state, p.lease_id = "leased", lease.lease_id
            p.held_by = [*(p.held_by or [])[-(HELD_BY - 1) :], f"{lease.lease_id} {replica_id}"]
            self._save_prompt(p)
        self.counts["leases_issued"] += 1
        self.log.put("leases", lease.lease_id, lease.record())
        self.save()
        return lease

    def end_lease(self, lease: Lease, wall: float, reason: str) -> None:
        """Return a lease's unsubmitted prompts to the front of the queue."""
        del self.leases[lease.lease_id]
        self.log.put("leases", lease.lease_id, None)
        back = []
        for i in lease.prompts:
            p = self.by_index.get(i)
            if p is not None and p.state == "leased" and p.lease_id == lease.lease_id:
                p.state, p.lease_id = "queued", None
                self._save_prompt(p)
                back.append(i)
        if back:
            self.requeue.extendleft(reversed(back))
            self.counts["leases_expired"] += 1
            self.log.event(
                "lease_expired",
                wall,
                lease_id=lease.lease_id,
                replica_id=lease.replica_id,
                prompts=len(back),
                indices=back,
                reason=reason,
            )
        self.save()

    def expire(self, now: float, wall: float) -> bool:
        """Dispatch again the prompts of leases past their deadline. True if any."""
        late = [le for le in self.leases.values() if le.deadline <= now]
        for le in late:
            self.end_lease(le, wall, "deadline passed")
        return bool(late)

    def drop_holder(self, replica_id: str, wall: float) -> bool:
        """A replica left or was evicted: its leases end at once (no waiting for the
        deadline). True if it held any."""
        mine = [le for le in self.leases.values() if le.replica_id == replica_id]
        for le in mine:
            self.end_lease(le, wall, f"holder {replica_id} gone")
        return bool(mine)

    # -- what submissions and training do to prompts ---------------------

    def verdict(self, index: int, attempt: int, lease_id: str, replica_id: str) -> str:
        """What a submitted rollout of prompt ``index`` (its ``attempt``) under
        ``lease_id`` by ``replica_id`` is: ``accept``, ``duplicate`` (a copy of one
        accepted, trained or discarded already) or ``unleased`` (that lease never held
        that attempt for that replica: never issued, made up, or another's)."""
        if index >= self.cursor:
            return "unleased"  # never issued
        p = self.by_index.get(index)
        if p is None or attempt < p.attempt:
            return "duplicate"  # trained, or an attempt discarded since
        if attempt > p.attempt:
            return "unleased"  # an attempt not dispatched yet
        if p.held_by is not None and f"{lease_id} {replica_id}" not in p.held_by:
            return "unleased"
        return "duplicate" if p.state == "done" else "accept"

    def holds(self, index: int, attempt: int, lease_id: str, replica_id: str, now: float) -> bool:
        """Whether ``lease_id`` is live (not past its deadline, even if no tick has ended it
        yet), is ``replica_id``'s, and holds attempt ``attempt`` of prompt ``index`` now:
        stricter than :meth:`verdict`, which also takes a late submission under a lease
        that ended (the first complete rollout wins), where progress reported under it
        would be for an episode that another replica may already be running."""
        p = self.by_index.get(index)
        le = self.leases.get(lease_id)
        return (
            p is not None
            and le is not None
            and (p.attempt, p.state, p.lease_id) == (attempt, "leased", lease_id)
            and le.replica_id == replica_id
            and le.deadline > now
        )

    def renew(self, lease_id: str, now: float) -> None:
        """Push a live lease's deadline to ``lease_s`` from ``now``: its holder reported an
        episode's completed turn, so an episode longer than ``rl.loop.lease_s`` stays
        with the replica running it, as long as each turn takes less than that."""
        le = self.leases.get(lease_id)
        if le is not None:
            le.deadline = max(le.deadline, now + self.lease_s)

    def done(self, index: int, lease_id: str) -> None:
        """A rollout of prompt ``index`` was accepted (under lease ``lease_id``, or a
        late copy under another): no lease holds the prompt any more."""
        p = self.by_index[index]
        if p.lease_id is not None and p.lease_id in self.leases:
            other = self.leases[p.lease_id]
            if other.lease_id != lease_id:
                other.prompts.remove(index)
                if other.prompts:
                    self.log.put("leases", other.lease_id, other.record())
                else:  # nothing left to submit: its holder is no longer busy
                    del self.leases[other.lease_id]
                    self.log.put("leases", other.lease_id, None)
        p.state, p.lease_id = "done", None
        self._save_prompt(p)

    def settle_lease(self, lease_id: str) -> None:
        """End a lease once every prompt of it is done (the holder is idle again)."""
        lease = self.leases.get(lease_id)
        if lease is not None and all(
            i not in self.by_index or self.by_index[i].state == "done" for i in lease.prompts
        ):
            del self.leases[lease_id]
            self.log.put("leases", lease_id, None)

    def again(self, index: int) -> None:
        """A rollout of the prompt was discarded: dispatch it again (next attempt)."""
        p = self.by_index[index]
        p.attempt += 1
        p.state, p.lease_id, p.held_by = "queued", None, []
        self.requeue.append(p.index)
        self._save_prompt(p)

    def reissue(self, index: int, attempt: int) -> None:
        """A trained prompt left the lineage (the job rolled back past its batch):
        dispatch it again, as ``attempt`` (a late copy of an older one is a duplicate)."""
        p = Prompt(index, attempt, held_by=[])
        self.by_index[index] = p
        self.requeue.append(index)
        self._save_prompt(p)

    def trained(self, index: int) -> None:
        self.by_index.pop(index)
        self.log.put("prompts", str(index), None)

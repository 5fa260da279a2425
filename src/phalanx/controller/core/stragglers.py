"""Stragglers: replicas that are alive but slow, found from their step times, given a
smaller share of the constant global batch, and evicted when that is not enough.

A replica reports, with each quorum request, the time its share of the last step
took and that share's samples (``QuorumReq.compute_s``, ``samples``). Per replica
the controller keeps the last ``window`` of each (``[controller.stragglers]``):

1. **Flag.** A replica whose median share time over the window is more than
   ``factor`` times the median of its peers' (each their own median) is a
   straggler: a ``straggler`` event (``action`` flagged).
2. **Rebalance.** A straggler's share weight is its peers' median per-sample time
   over its own, in thousandths of an equal share (:data:`FULL_SHARE`), at least
   ``min_share``. Per-sample times do not depend on the share, so the weight goes
   where every member finishes together: a replica at half speed gets half an
   equal share. The quorum carries the weights in rank order (``Quorum.shares``)
   and every member splits the global batch by them alike
   (:func:`phalanx.train.batch.share_of`): the batch is the same, only who takes
   which part changes. A weight moves only by more than :data:`HYSTERESIS` (each
   move changes every member's slice, which recomputes its share once).
3. **Evict.** A straggler at the floor whose share time is still more than
   ``factor`` times its peers' median, for ``window`` reports running, is evicted
   (detector ``straggler``). It may rejoin (its launcher or client registers it
   again): it then starts at the weight its name had, so it cannot slow every
   step meanwhile, and is watched again; a recovered one's weight goes back up, and
   it is cleared once it needs no less than :data:`CLEAR_AT` of an equal share.

A replica with fewer than ``window`` reports, or a role where fewer than two members
report, is not judged. Each role keeps its members' medians in sorted lists
(:class:`Speeds`), updated as each report comes in, so a report costs a bisection and a
list move, not a pass over the role: the watch stays cheap at thousands of replicas. What the controller knows here is not journaled: after a
restart the watch starts over (the quorums already journaled keep their shares).
No I/O; every decision is a function of the reports, in order.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from phalanx.config.stragglers import StragglersSection
from phalanx.controller.core.base import ChangeLog
from phalanx.protocol.quorum import FULL_SHARE

HYSTERESIS = 0.1
"""A straggler's weight changes only when the new one differs by more than this
fraction of the old."""
CLEAR_AT = 0.95
"""A straggler whose weight would be at least this fraction of an equal share is
cleared (its weight goes back to a full one)."""


@dataclass
class Watch:
    """What the controller knows of one replica's speed."""

    name: str
    role: str
    times: deque[float]
    """Its last ``window`` share times (seconds)."""
    rates: deque[float]
    """Its last ``window`` per-sample times (seconds per sample)."""
    weight: int = FULL_SHARE
    flagged: bool = False
    at_floor: int = 0
    """Reports running with its share at the floor and still too slow."""
    last_request: str = ""
    counted: tuple[float, float] | None = None
    """Its (median time, median per-sample time) as its role's :class:`Speeds` hold
    them, once its window is full; None before."""


def _median_without(values: list[float], x: float) -> float:
    """The median of the sorted ``values`` with one ``x`` (which they hold) left out,
    without copying them."""
    i = bisect.bisect_left(values, x)
    n = len(values) - 1

    def at(k: int) -> float:
        return values[k] if k < i else values[k + 1]

    return (at((n - 1) // 2) + at(n // 2)) / 2


@dataclass
class Speeds:
    """One role's medians of the members whose window is full: their share times and
    their per-sample times, each a sorted list."""

    times: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)

    def add(self, w: Watch) -> None:
        w.counted = (median(w.times), median(w.rates))
        bisect.insort(self.times, w.counted[0])
        bisect.insort(self.rates, w.counted[1])

    def remove(self, w: Watch) -> None:
        if w.counted is not None:
            self.times.pop(bisect.bisect_left(self.times, w.counted[0]))
            self.rates.pop(bisect.bisect_left(self.rates, w.counted[1]))
            w.counted = None

    def peers_of(self, w: Watch) -> tuple[float, float] | None:
        """The median of the other members' median times and per-sample times, or None
        when ``w`` has no peer with a full window."""
        if w.counted is None or len(self.times) < 2:
            return None
        return _median_without(self.times, w.counted[0]), _median_without(self.rates, w.counted[1])


@dataclass
class Verdict:
    """What one report decided: the replica to evict (and why), if any."""

    evict: str | None = None
    reason: str = ""


@dataclass
class Stragglers:
    """The straggler watch of every role (who calls: the controller's state, on each
    quorum request and eviction, and at quorum formation for the shares)."""

    cfg: StragglersSection
    log: ChangeLog
    watches: dict[str, Watch] = field(default_factory=dict)
    speeds: dict[str, Speeds] = field(default_factory=dict)
    """Role -> its members' medians (:class:`Speeds`)."""
    remembered: dict[tuple[str, str], int] = field(default_factory=dict)
    """(role, name) -> the weight of an incarnation evicted as a straggler, which a
    new incarnation of that name starts at."""
    flagged_total: dict[str, int] = field(default_factory=dict)
    evicted_total: dict[str, int] = field(default_factory=dict)

    def report(
        self,
        replica_id: str,
        name: str,
        role: str,
        request_id: str,
        compute_s: float | None,
        samples: int | None,
        *,
        wall: float,
    ) -> Verdict:
        """One quorum request's report. Returns the verdict (an eviction, or none)."""
        if not self.cfg.enabled:
            return Verdict()
        w = self.watches.get(replica_id)
        if w is None:
            n = self.cfg.window
            w = self.watches[replica_id] = Watch(name, role, deque(maxlen=n), deque(maxlen=n))
            kept = self.remembered.get((role, name))
            if kept is not None:
                w.weight, w.flagged = kept, True
        if compute_s is None or not samples:
            return Verdict()  # nothing computed yet (a joiner: it starts at its name's weight)
        if w.last_request == request_id:
            return Verdict()  # a retried request: counted once
        w.last_request = request_id
        w.times.append(compute_s)
        w.rates.append(compute_s / samples)
        speeds = self.speeds.setdefault(role, Speeds())
        speeds.remove(w)
        if len(w.times) >= self.cfg.window:
            speeds.add(w)
        return self._judge(replica_id, w, wall)

    def _judge(self, replica_id: str, w: Watch, wall: float) -> Verdict:
        peers = self.speeds[w.role].peers_of(w)
        if peers is None or w.counted is None:
            return Verdict()
        (peer_time, peer_rate), (mine_time, mine_rate) = peers, w.counted
        slow = peer_time > 0 and mine_time > self.cfg.factor * peer_time
        ratio = round(mine_time / peer_time, 2) if peer_time > 0 else 0.0
        if not w.flagged:
            if slow:
                w.flagged = True
                self.flagged_total[w.role] = self.flagged_total.get(w.role, 0) + 1
                self._reweigh(replica_id, w, peer_rate / mine_rate, ratio, "flagged", wall)
            return Verdict()
        wanted = peer_rate / mine_rate if mine_rate > 0 else 1.0
        if wanted >= CLEAR_AT and not slow:
            w.flagged, w.at_floor = False, 0
            self.remembered.pop((w.role, w.name), None)
            self._reweigh(replica_id, w, 1.0, ratio, "cleared", wall)
            return Verdict()
        self._reweigh(replica_id, w, wanted, ratio, "share", wall)
        floor = self._floor()
        w.at_floor = w.at_floor + 1 if w.weight <= floor and slow else 0
        if w.at_floor < self.cfg.window:
            return Verdict()
        self.remembered[(w.role, w.name)] = w.weight
        self.evicted_total[w.role] = self.evicted_total.get(w.role, 0) + 1
        return Verdict(
            replica_id,
            f"straggler: its share took {ratio}x its peers' median for {w.at_floor} steps "
            f"at the floor share ({self.cfg.min_share:g} of an equal share)",
        )

    def _floor(self) -> int:
        return max(1, round(self.cfg.min_share * FULL_SHARE))

    def _reweigh(
        self, replica_id: str, w: Watch, wanted: float, ratio: float, action: str, wall: float
    ) -> None:
        """Set ``w``'s weight to ``wanted`` of an equal share (within the floor and a
        full share), if it moves by more than :data:`HYSTERESIS`; said on the timeline."""
        new = min(FULL_SHARE, max(self._floor(), round(wanted * FULL_SHARE)))
        if action == "share" and abs(new - w.weight) <= HYSTERESIS * w.weight:
            return
        w.weight = new
        self.log.event(
            "straggler",
            wall,
            role=w.role,
            replica_id=replica_id,
            action=action,
            share=round(new / FULL_SHARE, 3),
            ratio=ratio,
        )

    def shares(self, ids: list[str]) -> tuple[int, ...]:
        """The share weights of a quorum of ``ids`` (rank order); empty when all are
        equal (the equal split: no straggler among them)."""
        weights = tuple(self.watches[r].weight if r in self.watches else FULL_SHARE for r in ids)
        return weights if any(x != FULL_SHARE for x in weights) else ()

    def forget(self, replica_id: str) -> None:
        """The replica left or was evicted: its reports no longer count."""
        w = self.watches.pop(replica_id, None)
        if w is not None and w.role in self.speeds:
            self.speeds[w.role].remove(w)

    def share_of(self, replica_id: str) -> float:
        """The replica's share weight as a fraction of an equal share."""
        w = self.watches.get(replica_id)
        return (w.weight if w is not None else FULL_SHARE) / FULL_SHARE

    def figures(self) -> dict[str, Any]:
        """Counters and per-replica shares, for ``/metrics``."""
        return {
            "flagged": dict(self.flagged_total),
            "evicted": dict(self.evicted_total),
            "shares": {rid: (w.role, w.weight / FULL_SHARE) for rid, w in self.watches.items()},
        }

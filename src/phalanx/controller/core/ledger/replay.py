"""The replay memory of the ledger: trained rollouts that later batches draw from
(``rl.loop.replay_ratio``), as in Coach's seed: rollout workers write memories,
the trainer samples a replay memory that may be larger than its machine.

**Filling.** When a batch is trained (acked: in the lineage), its fresh rollouts
enter the replay with their payloads as they are, behaviour log-probs and
version included, so the loss's importance weights use them unchanged.

- ``memory``: the replay is this book. Its index (one small record per entry,
  journaled in the ``replay`` table) lives in the controller, and the payloads
  stay where the rollout store holds them (the controller's payload log, or
  Redis or storage) instead of being dropped at the ack; an entry evicted past
  ``replay_size`` drops its payload then. A controller restart restores both.
- ``redis://``: the controller writes each trained rollout to the Redis replay
  (:class:`~phalanx.transport.replay.RedisReplayBuffer`, under the job's store
  name). Until that write is made, the rollout waits in the ``replay_out`` table
  with its payload kept, so nothing trained is lost to a server that is down
  or to a controller restart; the write is made by the service
  (:meth:`ReplayBook.outbox`, then :meth:`ReplayBook.written`).

**Drawing.** When batch ``b`` is frozen, ``k = round(replay_ratio *
prompts_per_step)`` rollouts (at most ``prompts_per_step - 1``: every batch
trains at least one fresh rollout) are drawn without replacement among the
replay's entries in insertion order, at positions picked by a generator seeded by
(job seed, ``b``) (:func:`positions`: the core draws nothing unseeded, so it
imports no ``random``). For Redis the count and the
entries at the drawn ranks are read on the server (``ZCARD``, ``ZRANGE`` by
rank). The frozen batch records the drawn entries (``replayed``), apart from
its fresh ``rollout_ids``, so every replica and every retry trains the same
batch and the fresh rollouts' accounting is untouched. A Redis draw sees what
the server holds at the freeze (rollouts still in the outbox are not drawn yet).

A rollback takes the replayed uses of the batches it takes back out of the
count with them, and leaves the replay as it is: an entry is behaviour data
with its own log-probs, whichever lineage trained it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from phalanx.controller.core.base import ChangeLog
from phalanx.protocol.replay import positions

SUMMARY = ("rollout_id", "prompt", "version", "reward", "exact_match")
"""The fields of a rollout record that a replayed entry carries into a batch."""


RETRY_S = 2.0
"""Seconds a Redis replay that failed a draw is left alone before the next ask."""


class ReplayUnavailable(Exception):
    """The replay's server could not be reached (the batch is frozen fresh only)."""


class RemoteReplay(Protocol):
    """What the ledger needs of a replay held outside the controller (Redis)."""

    def size(self) -> int: ...

    def entries_at(self, positions: list[int]) -> list[dict[str, Any] | None]: ...


class ReplayBook:
    def __init__(
        self,
        log: ChangeLog,
        counts: dict[str, int],
        drop: Callable[[str, str], None],
        *,
        kind: str | None,
        capacity: int,
        seed: int,
        prompts_per_step: int = 1,
        ratio: float = 0.0,
    ):
        self.log, self.counts, self.drop = log, counts, drop
        self.kind, self.capacity, self.seed = kind, capacity, seed
        self.pps, self.ratio = prompts_per_step, ratio
        """A batch's prompts, and the share of them drawn from the replay."""
        """``kind``: ``memory``, ``redis`` or None (no replay)."""
        self.entries: dict[str, dict[str, Any]] = {}
        """Memory: the held entries (summary, ``ref``, ``seq``), oldest first."""
        self.out: dict[str, dict[str, Any]] = {}
        """Redis: trained rollouts not yet written to the server (summary and ``ref``)."""
        self.remote: RemoteReplay | None = None
        """Redis: the server's replay, attached by the service once the run is known."""
        self.seq = 0
        self.retry_at = 0.0
        """Redis: wall time before which the server is not asked again after a failed
        draw (each ask would stall the controller's loop for the draw's timeout)."""

    def restore(self, tables: dict[str, dict[str, dict[str, Any]]]) -> None:
        rows = tables.get("replay", {}).values()
        self.entries = {r["rollout_id"]: r for r in sorted(rows, key=lambda r: r["seq"])}
        self.seq = max((r["seq"] for r in self.entries.values()), default=0)
        self.out = dict(tables.get("replay_out", {}))

    def refs(self) -> set[str]:
        """Payload refs the replay still needs (kept from the collector and the log)."""
        return {r["ref"] for r in self.entries.values()} | {r["ref"] for r in self.out.values()}

    # -- filling -----------------------------------------------------------

    def keep(self, rec: dict[str, Any], pinned: set[str]) -> bool:
        """A fresh rollout was trained: keep it for replay. False: no replay, the
        caller drops its payload. ``pinned``: entries drawn into frozen batches not yet
        trained, which an eviction skips (their payloads are about to be read)."""
        if self.kind is None:
            return False
        row = {k: rec[k] for k in SUMMARY} | {"ref": rec["ref"]}
        self.counts["replay_added"] += 1
        if self.kind == "redis":
            self.out[rec["rollout_id"]] = row
            self.log.put("replay_out", rec["rollout_id"], row)
            return True
        self.seq += 1
        row["seq"] = self.seq
        self.entries[rec["rollout_id"]] = row
        self.log.put("replay", rec["rollout_id"], row)
        over = len(self.entries) - self.capacity
        for rid in [r for r in self.entries if r not in pinned][: max(0, over)]:
            self.forget(rid, "trained")
            self.counts["replay_evicted"] += 1
        return True

    def forget(self, rid: str, reason: str, *, unwritten: bool = False) -> bool:
        """The entry leaves the replay, and its payload goes. ``unwritten``: also give
        up its write to the server when it waits for one (its payload is gone). False:
        not held."""
        tables = [("replay", self.entries)] + ([("replay_out", self.out)] if unwritten else [])
        for table, held in tables:
            row = held.pop(rid, None)
            if row is not None:
                self.log.put(table, rid, None)
                self.drop(row["ref"], reason)
                return True
        return False

    def outbox(self) -> list[dict[str, Any]]:
        """Redis: the trained rollouts to write (summary and ``ref``), oldest first."""
        return list(self.out.values())

    def written(self, ids: Iterable[str]) -> None:
        """Redis: these are on the server now; their payloads may go."""
        for rid in ids:
            row = self.out.pop(rid, None)
            if row is not None:
                self.log.put("replay_out", rid, None)
                self.drop(row["ref"], "trained")

    def unreachable(self, error: str, wall: float) -> None:
        """Redis: the outbox could not be written (it is kept, and retried)."""
        self.log.event("replay_write_waits", wall, error=error[:300])

    # -- drawing -------------------------------------------------------------

    def fresh_per_batch(self) -> int:
        """Fresh rollouts a batch takes: ``prompts_per_step`` less the ``k`` its draw
        replays, once the replay holds ``k`` (memory: its entries; Redis: the rollouts
        handed to it, the server's count without asking it). Prompt leases are
        throttled by this (``max_ahead`` batches of it): leasing for whole batches of
        fresh rollouts would let them wait for batches further ahead than
        ``max_ahead``, past ``max_staleness`` (a benchmark run with a quarter of each
        batch replayed discarded 596 of 4,200 fresh rollouts as stale)."""
        k = self.per_batch
        held = len(self.entries) if self.kind == "memory" else self.counts["replay_added"]
        return self.pps - k if k and held >= k else self.pps

    @property
    def per_batch(self) -> int:
        """k: the rollouts each batch draws from the replay, round(replay_ratio x
        prompts_per_step), at most all but one (every batch trains something fresh)."""
        return min(round(self.ratio * self.pps), self.pps - 1)

    def size(self, wall: float) -> int:
        """Entries to draw from; raises :class:`ReplayUnavailable` (and, for
        :data:`RETRY_S` after that, without asking the server again)."""
        if self.kind == "memory":
            return len(self.entries)
        if self.remote is None:
            raise ReplayUnavailable("the redis replay is not attached yet")
        if wall < self.retry_at:
            raise ReplayUnavailable("the redis replay did not answer a moment ago")
        try:
            return self.remote.size()
        except Exception as e:  # a TransportError, whatever the server did
            self.retry_at = wall + RETRY_S
            raise ReplayUnavailable(str(e)) from e

    def draw(self, index: int, k: int, n: int) -> list[dict[str, Any]]:
        """The ``min(k, n)`` entries batch ``index`` replays, among ``n`` held: the
        positions depend only on (seed, index, n). Raises :class:`ReplayUnavailable`."""
        at = positions(self.seed, index, n, k)
        if self.kind == "memory":
            held = list(self.entries.values())
            return [{f: held[p][f] for f in SUMMARY} for p in at]
        if self.remote is None:
            raise ReplayUnavailable("the redis replay is not attached yet")
        try:
            rows = self.remote.entries_at(at)
        except Exception as e:
            raise ReplayUnavailable(str(e)) from e
        return [{f: r[f] for f in SUMMARY} for r in rows if r is not None]

    def status(self, batched: int) -> dict[str, Any]:
        c = self.counts
        return {
            "kind": self.kind,
            "held": len(self.entries) if self.kind == "memory" else None,
            "unwritten": len(self.out),
            "added": c["replay_added"],
            "evicted": c["replay_evicted"],
            "batched": batched,
            "replayed": c["replayed_rollouts"],
            "lost": c["replay_lost"],
            "unavailable": c["replay_unavailable"],
        }

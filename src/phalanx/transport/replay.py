"""Replay buffers: uniform sampling over the last N rollouts (off-policy algorithms).

- :class:`MemoryReplayBuffer`: one process; a ring of ids and a dict of rollouts.
- :class:`RedisReplayBuffer`: shared by any number of processes
  (``redis://host:port/db``), and sampled on the server, so it may be larger
  than any one trainer's machine. Under ``phalanx:<name>:replay``:

  - ``:ids``: a sorted set of rollout ids, scored by insertion sequence
    (``:seq``, a counter), so rank 0 is the oldest held;
  - ``:data``: a hash, id -> the rollout as added (JSON: the payload as-is);
  - ``:meta``: a hash, id -> its summary (:data:`SUMMARY` fields, JSON), what a
    sampler needs without reading payloads.

  Adding and evicting (the lowest ranks past ``capacity``) run in one script, so
  the set and the hashes never disagree. A draw is positions (ranks) picked by
  the caller's ``random.Random`` among :meth:`~RedisReplayBuffer.size` entries,
  read with ``ZRANGE`` by rank (:meth:`~RedisReplayBuffer.entries_at`); the
  controller's ledger draws this way, seeded by (job seed, batch index), and
  the policy replicas read the drawn payloads by id (:meth:`~RedisReplayBuffer.get`).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from phalanx.protocol.rl import Batch, RolloutPayload
from phalanx.transport.base import ReplayBuffer, TransportError
from phalanx.transport.redis_conn import connect

if TYPE_CHECKING:
    from phalanx.config.rl import TransportSection

log = logging.getLogger("phalanx.transport")


def _check_capacity(capacity: int) -> None:
    if capacity < 1:
        raise ValueError(f"replay capacity must be >= 1: got {capacity}.")


class MemoryReplayBuffer(ReplayBuffer):
    def __init__(self, capacity: int):
        _check_capacity(capacity)
        self.capacity = capacity
        self._ring: list[str] = []
        self._head = 0
        """Next slot to overwrite once the ring is full (the oldest id)."""
        self._data: dict[str, dict[str, Any]] = {}

    def add(self, rollouts: Sequence[Mapping[str, Any]]) -> int:
        new = 0
        for r in rollouts:
            rid = str(r["rollout_id"])
            if rid in self._data:
                continue
            new += 1
            if len(self._ring) < self.capacity:
                self._ring.append(rid)
            else:
                del self._data[self._ring[self._head]]
                self._ring[self._head] = rid
                self._head = (self._head + 1) % self.capacity
            self._data[rid] = dict(r)
        return new

    def sample(self, k: int, rng: random.Random | None = None) -> list[dict[str, Any]]:
        if not self._ring:
            return []
        rng = rng or random.Random()
        return [self._data[self._ring[rng.randrange(len(self._ring))]] for _ in range(k)]

    def entries_at(self, positions: Sequence[int]) -> list[dict[str, Any]]:
        """The rollouts at these ranks, 0 the oldest held (as
        :meth:`RedisReplayBuffer.entries_at` ranks them): a caller's seeded draw."""
        order = self._ring[self._head :] + self._ring[: self._head]
        return [self._data[order[p]] for p in positions]

    def __len__(self) -> int:
        return len(self._ring)


SUMMARY = ("rollout_id", "prompt", "version", "reward", "exact_match")
"""The fields of an added rollout kept in ``:meta`` (those present)."""

# KEYS: ids (sorted set), data (hash), meta (hash), seq (counter);
# ARGV: capacity, then (id, data json, meta json) triples.
ADD = """
local new = 0
for i = 2, #ARGV, 3 do
  if redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 1]) == 1 then
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[i + 2])
    redis.call('ZADD', KEYS[1], redis.call('INCR', KEYS[4]), ARGV[i])
    new = new + 1
  end
end
local over = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[1])
if over > 0 then
  for _, id in ipairs(redis.call('ZPOPMIN', KEYS[1], over)) do
    if _ % 2 == 1 then
      redis.call('HDEL', KEYS[2], id)
      redis.call('HDEL', KEYS[3], id)
    end
  end
end
return new
"""


class RedisReplayBuffer(ReplayBuffer):
    def __init__(self, url: str, name: str, capacity: int, *, timeout_s: float | None = None):
        """``timeout_s``: socket timeouts of the connection (None: the transport's), so a
        caller that must not stall on a server that went away (the controller's ledger)
        hears :class:`TransportError` soon."""
        import redis

        _check_capacity(capacity)
        self.r, self.capacity = connect(url), capacity
        if timeout_s is not None:
            kw = self.r.connection_pool.connection_kwargs
            kw["socket_timeout"] = kw["socket_connect_timeout"] = timeout_s
        base = f"phalanx:{name}:replay"
        self.ids, self.data, self.meta = f"{base}:ids", f"{base}:data", f"{base}:meta"
        self.seq = f"{base}:seq"
        self._add = self.r.register_script(ADD)
        self._error = redis.RedisError

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._error as e:
            raise TransportError(f"redis replay buffer {self.ids}: {e}") from e

    def add(self, rollouts: Sequence[Mapping[str, Any]]) -> int:
        if not rollouts:
            return 0
        args: list[Any] = [self.capacity]
        for r in rollouts:
            summary = {k: r[k] for k in SUMMARY if k in r}
            args += [
                str(r["rollout_id"]),
                json.dumps(r, separators=(",", ":")),
                json.dumps(summary, separators=(",", ":")),
            ]
        keys = [self.ids, self.data, self.meta, self.seq]
        return int(self._call(self._add, keys=keys, args=args))

    def size(self) -> int:
        """Entries held (``ZCARD``)."""
        return int(self._call(self.r.zcard, self.ids))

    def entries_at(self, positions: Sequence[int]) -> list[dict[str, Any] | None]:
        """The summaries at these ranks (0: the oldest held), read on the server; None
        for a rank past the end (evicted since the caller counted)."""
        if not positions:
            return []
        pipe = self.r.pipeline(transaction=False)
        for pos in positions:
            pipe.zrange(self.ids, pos, pos)
        ids = [hit[0] if hit else None for hit in self._call(pipe.execute)]
        held = [i for i in ids if i is not None]
        rows = (
            dict(zip(held, self._call(self.r.hmget, self.meta, held), strict=True)) if held else {}
        )
        return [
            json.loads(rows[i]) if i is not None and rows.get(i) is not None else None for i in ids
        ]

    def get(self, ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The rollouts held under these ids, as added (an evicted id is left out)."""
        if not ids:
            return {}
        rows = self._call(self.r.hmget, self.data, list(ids))
        return {i: json.loads(x) for i, x in zip(ids, rows, strict=True) if x is not None}

    def sample(self, k: int, rng: random.Random | None = None) -> list[dict[str, Any]]:
        rng = rng or random.Random()
        out: list[dict[str, Any]] = []
        for _ in range(8):  # evictions between the draw and the read are rare
            n = self.size()
            if n == 0 or len(out) >= k:
                break
            pipe = self.r.pipeline(transaction=False)
            for _ in range(k - len(out)):
                pipe.zrange(self.ids, pos := rng.randrange(n), pos)
            ids = [hit[0] for hit in self._call(pipe.execute) if hit]
            if ids:
                rows = self._call(self.r.hmget, self.data, ids)
                out += [json.loads(x) for x in rows if x is not None]
        return out

    def __len__(self) -> int:
        return self.size()

    def close(self) -> None:
        self.r.close()


ReplayReader = RedisReplayBuffer
"""What a policy replica reads replayed payloads from (by id)."""


def replay_reader(t: TransportSection, name: str) -> ReplayReader | None:
    """A policy replica's reader of the job's Redis replay (``name``: the job's store
    name), or None: no replay, or a ``memory`` one (its payloads come with the batch)."""
    if t.replay is None or t.replay == "memory":
        return None
    return RedisReplayBuffer(t.replay, name, t.replay_size)


def replayed_payloads(batch: Batch, replay: ReplayReader | None) -> dict[str, RolloutPayload]:
    """The payloads of the batch's replayed rollouts that came without one, read by id
    from the Redis replay (one ``HMGET``); an id it no longer holds is left out (the
    caller reports it lost, and the ledger draws the batch again), and so is every
    id when the server does not answer (the ledger's new draw then fails too, and
    the batch is frozen from fresh rollouts only)."""
    ids = [r.rollout_id for r in batch.rollouts if r.replayed and not (r.ref or r.completions)]
    if not ids or replay is None:
        return {}
    try:
        held = replay.get(ids)
    except TransportError as e:
        log.warning(
            "replay: %d replayed payload(s) of batch %d unread: %s", len(ids), batch.index, e
        )
        return {}
    out: dict[str, RolloutPayload] = {}
    for rid, doc in held.items():
        try:
            out[rid] = RolloutPayload.model_validate(
                {k: doc[k] for k in ("rollout_id", "version", "completions")}, strict=False
            )
        except (KeyError, ValidationError):
            continue  # not a payload: reported lost
    return out

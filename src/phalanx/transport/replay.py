"""Replay buffers: uniform sampling over the last N rollouts (off-policy algorithms).

- :class:`MemoryReplayBuffer`: one process; a ring of ids and a dict of rollouts.
- :class:`RedisReplayBuffer`: shared by any number of processes
  (``redis://host:port/db``): a list of ids, newest first, and a hash of
  rollouts, under ``phalanx:<name>:replay``. Adding and evicting run in one
  script, so the list and the hash never disagree; sampling draws positions,
  then reads them, and draws again for any evicted in between.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from typing import Any

from phalanx.transport.base import ReplayBuffer, TransportError
from phalanx.transport.redis_conn import connect


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

    def __len__(self) -> int:
        return len(self._ring)


# KEYS: ids (list, newest first), data (hash); ARGV: capacity, then (id, json) pairs.
ADD = """
local new = 0
for i = 2, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 1]) == 1 then
    redis.call('LPUSH', KEYS[1], ARGV[i])
    new = new + 1
  end
end
local cap = tonumber(ARGV[1])
while redis.call('LLEN', KEYS[1]) > cap do
  redis.call('HDEL', KEYS[2], redis.call('RPOP', KEYS[1]))
end
return new
"""


class RedisReplayBuffer(ReplayBuffer):
    def __init__(self, url: str, name: str, capacity: int):
        import redis

        _check_capacity(capacity)
        self.r, self.capacity = connect(url), capacity
        base = f"phalanx:{name}:replay"
        self.ids, self.data = f"{base}:ids", f"{base}:data"
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
            args += [str(r["rollout_id"]), json.dumps(r, separators=(",", ":"))]
        return int(self._call(self._add, keys=[self.ids, self.data], args=args))

    def sample(self, k: int, rng: random.Random | None = None) -> list[dict[str, Any]]:
        rng = rng or random.Random()
        out: list[dict[str, Any]] = []
        for _ in range(8):  # evictions between the draw and the read are rare
            n = int(self._call(self.r.llen, self.ids))
            if n == 0 or len(out) >= k:
                break
            pipe = self.r.pipeline(transaction=False)
            for _ in range(k - len(out)):
                pipe.lindex(self.ids, rng.randrange(n))
            ids = [i for i in self._call(pipe.execute) if i is not None]
            if ids:
                rows = self._call(self.r.hmget, self.data, ids)
                out += [json.loads(x) for x in rows if x is not None]
        return out

    def __len__(self) -> int:
        return int(self._call(self.r.llen, self.ids))

    def close(self) -> None:
        self.r.close()

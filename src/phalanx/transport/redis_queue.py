"""A rollout queue on Redis Streams (``redis://host:port/db``).

One stream per job, one consumer group per consuming role (``policy``),
one consumer per replica. Keys, under ``phalanx:<name>:rollouts``:

- ``:stream``: the entries, each ``{id, data (JSON), crc (crc32 of data)}``,
  and ``n`` (the deliveries before) on an entry a nack put back;
- ``:ids``: hash rollout id -> ``q`` (queued), ``a <nonce>`` (acked),
  ``d <nonce>`` (discarded; the nonce of the settle call that counted it):
  the deduplication index. A put of a known id is dropped; an entry whose id
  is already acked is skipped on delivery;
- ``:counts``: hash of counters (put, duplicates, acked, corrupt, discarded:*);
- ``:quarantine``: a stream of the raw fields of corrupt entries;
- ``:leases``: sorted set entry id -> the deadline of its lease (ms, Redis's
  clock), set by the consumer that leased it with that consumer's ``lease_s``.

Delivery is at-least-once: ``XREADGROUP`` hands out new entries, and an entry
whose lease passed its deadline (its consumer died or stalled) is taken over
by the next consumer to lease, with ``XCLAIM`` in one script. Expiry follows
the holder's lease, not the claimer's: a consumer with a 60 s lease takes over
a dead consumer's 1 s leases after 1 s. An entry pending with no deadline (its
consumer died between the read and the deadline's write) is taken over once
idle past the claimer's own lease. The group reads the
stream from its start, so a consumer that starts late misses nothing (unlike
pub/sub). An entry leaves the stream only once acked (``XACK`` then ``XDEL``,
in one script): trimming never drops an unacknowledged rollout. The id index
is kept for the life of the job (a few dozen bytes per rollout) so that a
late duplicate is still recognised.

An id is consumed once: the first ack or discard of it, by any consumer, sets
its state and counts; a later one (a consumer whose lease expired and whose
entry was taken over) counts nothing. The state keeps the counting call's
nonce, so that the same call resent by redis-py after its reply was lost
(a timeout, a dropped connection) still learns that it counted. A nack gives
an entry back only if this consumer still holds it under that attempt: a
stale nack leaves its new holder alone.
"""

from __future__ import annotations

import json
import time
import uuid
import zlib
from collections.abc import Mapping, Sequence
from typing import Any
from urllib.parse import urlsplit

from phalanx.transport.base import Delivery, RolloutQueue, TransportError

PUT = """
local added = {}
for i = 1, #ARGV, 3 do
  if redis.call('HSETNX', KEYS[2], ARGV[i], 'q') == 1 then
    redis.call('XADD', KEYS[1], '*', 'id', ARGV[i], 'data', ARGV[i + 1], 'crc', ARGV[i + 2])
    table.insert(added, ARGV[i])
  else
    redis.call('HINCRBY', KEYS[3], 'duplicates', 1)
  end
end
redis.call('HINCRBY', KEYS[3], 'put', #added)
return added
"""

# KEYS: stream, ids, counters, quarantine, leases. ARGV: group, consumer, n, lease ms.
# Takes over up to n entries whose lease is past its deadline (or, with no
# deadline, idle past this consumer's lease); returns {id, times delivered, fields}.
CLAIM = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n, lease = tonumber(ARGV[3]), tonumber(ARGV[4])
local pick = redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now, 'LIMIT', 0, n)
if #pick < n then
  for _, p in ipairs(redis.call('XPENDING', KEYS[1], ARGV[1], 'IDLE', lease, '-', '+', 128)) do
    if #pick >= n then break end
    if not redis.call('ZSCORE', KEYS[5], p[1]) then table.insert(pick, p[1]) end
  end
end
local out = {}
for _, eid in ipairs(pick) do
  local c = redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, eid)
  if #c > 0 and c[1][2] then
    redis.call('ZADD', KEYS[5], now + lease, eid)
    local p = redis.call('XPENDING', KEYS[1], ARGV[1], eid, eid, 1)
    table.insert(out, {eid, p[1][4], c[1][2]})
  else
    redis.call('ZREM', KEYS[5], eid)
  end
end
return out
"""

# KEYS: leases. ARGV: lease ms, then entry ids: their deadline, on Redis's clock.
DEADLINE = """
local t = redis.call('TIME')
local due = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], due, ARGV[i]) end
return #ARGV - 1
"""

# ARGV: group, state ('a' or 'd:<reason>'), the call's nonce, then (entry id, rollout
# id) pairs. Counts only the first ack/discard of an id (and the same call sent again:
# redis-py resends a command whose reply was lost, and the id then holds its nonce);
# always removes the entry.
SETTLE = """
local n = 0
local mark = string.sub(ARGV[2], 1, 1) .. ' ' .. ARGV[3]
for i = 4, #ARGV, 2 do
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
  redis.call('XDEL', KEYS[1], ARGV[i])
  redis.call('ZREM', KEYS[5], ARGV[i])
  local cur = redis.call('HGET', KEYS[2], ARGV[i + 1])
  if cur == 'q' or cur == false then
    redis.call('HSET', KEYS[2], ARGV[i + 1], mark)
    if ARGV[2] == 'a' then
      redis.call('HINCRBY', KEYS[3], 'acked', 1)
    else
      redis.call('HINCRBY', KEYS[3], 'discarded:' .. string.sub(ARGV[2], 3), 1)
    end
    n = n + 1
  elseif cur == mark then
    n = n + 1
  end
end
return n
"""

# ARGV: group, consumer, then (entry id, attempt) pairs. An entry still pending with
# this consumer under that attempt goes back to the stream's tail as a fresh entry
# (consumer groups cannot un-deliver one) that records the attempts made so far
# (field n); a stale nack (the lease expired and another consumer took the entry
# over) changes nothing.
NACK = """
local n = 0
for i = 3, #ARGV, 2 do
  local e = redis.call('XRANGE', KEYS[1], ARGV[i], ARGV[i])
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #e > 0 and #p > 0 and p[1][2] == ARGV[2] then
    local fields, prior = {}, 0
    for j = 1, #e[1][2], 2 do
      if e[1][2][j] == 'n' then
        prior = tonumber(e[1][2][j + 1])
      else
        table.insert(fields, e[1][2][j])
        table.insert(fields, e[1][2][j + 1])
      end
    end
    if prior + p[1][4] == tonumber(ARGV[i + 1]) then
      redis.call('ZREM', KEYS[5], ARGV[i])
      redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
      redis.call('XDEL', KEYS[1], ARGV[i])
      table.insert(fields, 'n')
      table.insert(fields, ARGV[i + 1])
      redis.call('XADD', KEYS[1], '*', unpack(fields))
      n = n + 1
    end
  end
end
return n
"""

# ARGV: group, entry id, then the entry's fields (flattened).
QUARANTINE = """
redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[1], ARGV[2])
redis.call('ZREM', KEYS[5], ARGV[2])
redis.call('XADD', KEYS[4], '*', 'entry', ARGV[2], unpack(ARGV, 3))
redis.call('HINCRBY', KEYS[3], 'corrupt', 1)
return 1
"""


def connect(url: str) -> Any:
    """A Redis client for ``redis://host:port/db``, or TransportError."""
    try:
        import redis
    except ImportError as e:
        raise TransportError(
            f"a redis:// transport needs the redis package: got {url!r} and no redis-py. "
            f"Install phalanx with the redis extra (pip install 'phalanx[redis]')."
        ) from e
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss") or not parts.hostname:
        raise TransportError(
            f"redis URL must look like redis://host:port/db: got {url!r}. Name the server."
        )
    return redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=10)


def crc(data: bytes) -> str:
    return str(zlib.crc32(data))


def nonce() -> str:
    """Marks the ids one settle call settles (SETTLE: that call, resent, counts them)."""
    return uuid.uuid4().hex[:12]


def prior_attempts(fields: dict[bytes, bytes]) -> int:
    """Deliveries of an entry's rollout before the entry was re-added by a nack."""
    try:
        return max(0, int(fields.get(b"n", b"0")))
    except ValueError:
        return 0


class RedisRolloutQueue(RolloutQueue):
    def __init__(
        self,
        url: str,
        name: str,
        consumer: str,
        *,
        group: str = "policy",
        lease_s: float = 30.0,
    ):
        import redis

        self.r = connect(url)
        self.lease_s, self.group, self.consumer = lease_s, group, consumer
        base = f"phalanx:{name}:rollouts"
        self.stream, self.ids = f"{base}:stream", f"{base}:ids"
        self.counters, self.quarantine = f"{base}:counts", f"{base}:quarantine"
        self.leases = f"{base}:leases"
        self._keys = [self.stream, self.ids, self.counters, self.quarantine, self.leases]
        self._put = self.r.register_script(PUT)
        self._settle = self.r.register_script(SETTLE)
        self._nack = self.r.register_script(NACK)
        self._quarantine = self.r.register_script(QUARANTINE)
        self._claim = self.r.register_script(CLAIM)
        self._deadline = self.r.register_script(DEADLINE)
        self._error = redis.RedisError
        try:
            # From id 0: a group created after the first puts still gets them.
            self.r.xgroup_create(self.stream, group, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise TransportError(f"redis queue {url}: {e}") from e
        except redis.RedisError as e:
            raise TransportError(f"redis queue {url} unreachable: {e}") from e

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._error as e:
            raise TransportError(f"redis rollout queue {self.stream}: {e}") from e

    def put(self, rollouts: Sequence[Mapping[str, Any]]) -> list[str]:
        if not rollouts:
            return []
        args: list[str | bytes] = []
        for r in rollouts:
            data = json.dumps(r, separators=(",", ":")).encode()
            args += [str(r["rollout_id"]), data, crc(data)]
        added = self._call(self._put, keys=self._keys, args=args)
        return [a.decode() for a in added]

    def _decode(self, eid: bytes, fields: dict[bytes, bytes]) -> Delivery | None:
        """The delivery of a stream entry, or None after quarantining a corrupt one."""
        try:
            data = fields[b"data"]
            if fields[b"crc"].decode() != crc(data):
                raise ValueError("checksum mismatch")
            rollout = json.loads(data)
            rid = fields[b"id"].decode()
            if not isinstance(rollout, dict) or rollout.get("rollout_id") != rid:
                raise ValueError("rollout id mismatch")
        except (KeyError, ValueError, UnicodeDecodeError):
            flat = [x for kv in fields.items() for x in kv]
            self._call(self._quarantine, keys=self._keys, args=[self.group, eid, *flat])
            return None
        return Delivery(rid, rollout, eid.decode(), 1, time.time() + self.lease_s)

    def lease(self, n: int, wait_s: float = 0.0) -> list[Delivery]:
        got: list[tuple[bytes, dict[bytes, bytes], int]] = []
        # Entries whose holder's lease is past its deadline: it died or stalled.
        args = [self.group, self.consumer, n, int(self.lease_s * 1000)]
        for eid, times, flat in self._call(self._claim, keys=self._keys, args=args):
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            got.append((eid, fields, int(times)))
        if len(got) < n:
            block = None if got or wait_s <= 0 else max(1, int(wait_s * 1000))
            reply = self._call(
                self.r.xreadgroup,
                self.group,
                self.consumer,
                {self.stream: ">"},
                count=n - len(got),
                block=block,
            )
            fresh = [(eid, fields, 1) for _, entries in reply or [] for eid, fields in entries]
            if fresh:
                ids = [eid for eid, _, _ in fresh]
                self._call(
                    self._deadline, keys=[self.leases], args=[int(self.lease_s * 1000), *ids]
                )
            got += fresh
        if not got:
            return []
        out: list[Delivery] = []
        done: list[tuple[bytes, str]] = []
        states = self._call(self.r.hmget, self.ids, [f.get(b"id", b"") for _, f, _ in got])
        for (eid, fields, times), state in zip(got, states, strict=True):
            if state is not None and state[:1] in (b"a", b"d"):
                done.append((eid, fields[b"id"].decode()))  # acked by a late consumer: drop
                continue
            d = self._decode(eid, fields)
            if d is not None:
                attempt = prior_attempts(fields) + times
                out.append(Delivery(d.rollout_id, d.rollout, d.receipt, attempt, d.deadline))
        if done:
            flat = [x for pair in done for x in pair]
            self._call(self._settle, keys=self._keys, args=[self.group, "a", nonce(), *flat])
        return out

    def _settle_all(self, deliveries: Sequence[Delivery], state: str) -> int:
        if not deliveries:
            return 0
        flat = [x for d in deliveries for x in (d.receipt, d.rollout_id)]
        args = [self.group, state, nonce(), *flat]
        return int(self._call(self._settle, keys=self._keys, args=args))

    def ack(self, deliveries: Sequence[Delivery]) -> int:
        return self._settle_all(deliveries, "a")

    def discard(self, deliveries: Sequence[Delivery], reason: str) -> int:
        return self._settle_all(deliveries, f"d:{reason}")

    def nack(self, deliveries: Sequence[Delivery]) -> int:
        if not deliveries:
            return 0
        args = [self.group, self.consumer, *(x for d in deliveries for x in (d.receipt, d.attempt))]
        return int(self._call(self._nack, keys=self._keys, args=args))

    def pending(self) -> int:
        return int(self._call(self.r.xlen, self.stream))

    def counts(self) -> dict[str, Any]:
        raw = {k.decode(): int(v) for k, v in self._call(self.r.hgetall, self.counters).items()}
        return {
            "put": raw.get("put", 0),
            "acked": raw.get("acked", 0),
            "duplicates": raw.get("duplicates", 0),
            "corrupt": raw.get("corrupt", 0),
            "discarded": {
                k.removeprefix("discarded:"): v
                for k, v in sorted(raw.items())
                if k.startswith("discarded:")
            },
        }

    def close(self) -> None:
        self.r.close()

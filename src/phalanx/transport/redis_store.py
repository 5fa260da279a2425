"""A rollout store on Redis (``redis://host:port/db``): payloads by ref.

Keys, under ``phalanx:<name>:payloads`` (``name`` is the job id and the
ledger's run, so reruns and jobs sharing a server stay apart):

- ``:p:<ref>``: ``<crc32>:<payload JSON>``, written once (``SET NX``);
- ``:counts``: hash of counters (put, trained, discarded:<reason>, corrupt);
- ``:quarantine:<ref>``: a payload that failed its checksum, set aside.

A put is one pipeline; a get one ``MGET``; a drop one Lua script that
deletes and counts only what was still there (so a drop retried after a
lost reply counts once).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any

from pydantic import ValidationError

from phalanx.protocol.rl import RolloutPayload
from phalanx.transport.base import RolloutStore, TransportError, new_ref
from phalanx.transport.redis_conn import connect

# KEYS[1]: the counts hash; ARGV: reason, then the payload keys.
DROP = """
local n = 0
for i = 2, #ARGV do
  n = n + redis.call('DEL', ARGV[i])
end
if n > 0 then
  local field = ARGV[1] == 'trained' and 'trained' or ('discarded:' .. ARGV[1])
  redis.call('HINCRBY', KEYS[1], field, n)
end
return n
"""


class RedisRolloutStore(RolloutStore):
    def __init__(self, url: str, name: str):
        import redis

        self.r = connect(url)
        self.url = url
        self.base = f"phalanx:{name}:payloads"
        self.counters = f"{self.base}:counts"
        self._drop = self.r.register_script(DROP)
        self._error = redis.RedisError

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._error as e:
            raise TransportError(f"redis rollout store {self.base} at {self.url}: {e}") from e

    def _key(self, ref: str) -> str:
        return f"{self.base}:p:{ref}"

    def put(self, payloads: Sequence[RolloutPayload]) -> list[str]:
        refs = [new_ref(p.rollout_id) for p in payloads]
        if not refs:
            return []
        pipe = self.r.pipeline(transaction=False)
        for ref, p in zip(refs, payloads, strict=True):
            data = p.model_dump_json().encode()
            pipe.set(self._key(ref), b"%d:" % zlib.crc32(data) + data, nx=True)
        pipe.hincrby(self.counters, "put", len(refs))
        self._call(pipe.execute)
        return refs

    def get(self, refs: Sequence[str]) -> tuple[dict[str, RolloutPayload], dict[str, str]]:
        if not refs:
            return {}, {}
        raw = self._call(self.r.mget, [self._key(r) for r in refs])
        found: dict[str, RolloutPayload] = {}
        lost: dict[str, str] = {}
        for ref, value in zip(refs, raw, strict=True):
            if value is None:
                lost[ref] = "payload_missing"
                continue
            try:
                crc, _, data = value.partition(b":")
                if int(crc) != zlib.crc32(data):
                    raise ValueError("checksum mismatch")
                found[ref] = RolloutPayload.model_validate_json(data)
            except (ValueError, ValidationError):
                lost[ref] = "payload_corrupt"
                pipe = self.r.pipeline(transaction=False)
                pipe.rename(self._key(ref), f"{self.base}:quarantine:{ref}")
                pipe.hincrby(self.counters, "corrupt", 1)
                try:
                    pipe.execute()
                except self._error:
                    pass  # a concurrent reader set it aside first
        return found, lost

    def drop(self, refs: Sequence[str], reason: str) -> int:
        if not refs:
            return 0
        args = [reason, *(self._key(r) for r in refs)]
        return int(self._call(self._drop, keys=[self.counters], args=args))

    def refs(self) -> list[str]:
        prefix = f"{self.base}:p:"
        keys = self._call(lambda: list(self.r.scan_iter(match=f"{prefix}*", count=1000)))
        return [k.decode().removeprefix(prefix) for k in keys]

    def counts(self) -> dict[str, Any]:
        raw = {k.decode(): int(v) for k, v in self._call(self.r.hgetall, self.counters).items()}
        return {
            "put": raw.get("put", 0),
            "held": len(self.refs()),
            "trained": raw.get("trained", 0),
            "corrupt": raw.get("corrupt", 0),
            "discarded": {
                k.removeprefix("discarded:"): v
                for k, v in sorted(raw.items())
                if k.startswith("discarded:")
            },
        }

    def close(self) -> None:
        self.r.close()

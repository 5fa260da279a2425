"""Published policy weights in Redis, for small models (``redis://host:port/db``).

Keys, under ``phalanx:<name>:weights``:

- ``:v:<version>``: the safetensors bytes of one version;
- ``:meta:<version>``: JSON ``{sha256, nbytes, meta}``;
- ``:versions``: sorted set of the versions held;
- ``:latest``: the pointer, the newest published version;
- channel ``:published``: a notification per publish.

A publish writes the bytes and the metadata, then moves the pointer, in one
``MULTI``: a reader that follows the pointer finds a complete version. The
notification only wakes waiters early: :meth:`wait_newer` re-reads the
pointer whatever it hears (and at least every ``poll_s``), so a lost or
missed message (a subscriber that started late) costs latency, never
correctness. Versions beyond the newest ``keep`` are deleted after the
pointer moved. A Redis value holds at most 512 MiB: bigger models publish to
storage.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Mapping
from typing import Any

import torch

from phalanx.comm.base import CommError
from phalanx.transport.base import TransportError, WeightStore
from phalanx.transport.redis_conn import connect
from phalanx.transport.storage_weights import from_bytes, to_bytes

MAX_BYTES = 512 << 20

# KEYS: latest, versions, blob, meta; ARGV: version, blob, meta json, channel.
PUBLISH = """
redis.call('SET', KEYS[3], ARGV[2])
redis.call('SET', KEYS[4], ARGV[3])
redis.call('ZADD', KEYS[2], tonumber(ARGV[1]), ARGV[1])
local cur = tonumber(redis.call('GET', KEYS[1]) or '-1')
if tonumber(ARGV[1]) > cur then redis.call('SET', KEYS[1], ARGV[1]) end
redis.call('PUBLISH', ARGV[4], ARGV[1])
return 1
"""


class RedisWeightStore(WeightStore):
    def __init__(self, url: str, name: str, *, keep: int = 2):
        import redis

        if keep < 1:
            raise ValueError(f"keep must be >= 1: got {keep}.")
        self.r, self.url, self.keep = connect(url), url, keep
        self.base = f"phalanx:{name}:weights"
        self.channel = f"{self.base}:published"
        self._publish = self.r.register_script(PUBLISH)
        self._error = redis.RedisError
        self._sub: Any = None

    def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._error as e:
            raise TransportError(f"redis weight store {self.base}: {e}") from e

    def publish(
        self, version: int, weights: Mapping[str, torch.Tensor], meta: Mapping[str, Any] = {}
    ) -> int:
        blob = to_bytes(weights)
        if len(blob) > MAX_BYTES:
            raise TransportError(
                f"weights published to redis must fit a Redis value (512 MiB): got "
                f"{len(blob) >> 20} MiB. Publish this model to storage (rl.transport.weights = "
                f"'file://...' or 's3://...')."
            )
        info = {"sha256": hashlib.sha256(blob).hexdigest(), "nbytes": len(blob), "meta": dict(meta)}
        keys = [
            f"{self.base}:latest",
            f"{self.base}:versions",
            f"{self.base}:v:{version}",
            f"{self.base}:meta:{version}",
        ]
        self._call(self._publish, keys=keys, args=[version, blob, json.dumps(info), self.channel])
        old = self._call(self.r.zrange, f"{self.base}:versions", 0, -self.keep - 1)
        if old:
            pipe = self.r.pipeline(transaction=True)
            for v in old:
                pipe.delete(f"{self.base}:v:{v.decode()}", f"{self.base}:meta:{v.decode()}")
            pipe.zrem(f"{self.base}:versions", *old)
            self._call(pipe.execute)
        return len(blob)

    def latest(self) -> tuple[int, dict[str, Any]] | None:
        for _ in range(5):
            v = self._call(self.r.get, f"{self.base}:latest")
            if v is None:
                return None
            raw = self._call(self.r.get, f"{self.base}:meta:{v.decode()}")
            if raw is not None:
                return int(v), dict(json.loads(raw)["meta"])
        return None

    def versions(self) -> list[int]:
        return [int(v) for v in self._call(self.r.zrange, f"{self.base}:versions", 0, -1)]

    def fetch(self, version: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        for _ in range(5):
            v = version
            if v is None:
                cur = self._call(self.r.get, f"{self.base}:latest")
                if cur is None:
                    raise CommError(f"no weights published yet in {self.url} ({self.base}).")
                v = int(cur)
            pipe = self.r.pipeline(transaction=True)
            pipe.get(f"{self.base}:meta:{v}")
            pipe.get(f"{self.base}:v:{v}")
            raw, blob = self._call(pipe.execute)
            if raw is not None and blob is not None:
                info = json.loads(raw)
                return v, from_bytes(blob, info["sha256"], f"{self.url} {self.base}:v:{v}")
            if version is not None:
                raise CommError(
                    f"weights version {version} must be in {self.url} to be fetched: got "
                    f"versions {self.versions()}. Older versions are collected "
                    f"(keep={self.keep}); fetch the latest."
                )
            # The pointer moved and collected this one between our reads: follow it.
        raise CommError(f"the latest weights in {self.url} kept vanishing while read.")

    def _wait(self, seconds: float) -> None:
        # The notification is a wake-up hint; wait_newer re-reads the pointer after it.
        try:
            if self._sub is None:
                self._sub = self.r.pubsub(ignore_subscribe_messages=True)
                self._sub.subscribe(self.channel)
            self._sub.get_message(timeout=seconds)
        except self._error:
            self._sub = None
            time.sleep(seconds)

    def wait_newer(
        self, version: int, timeout_s: float, poll_s: float = 0.25
    ) -> tuple[int, dict[str, Any]] | None:
        return super().wait_newer(version, timeout_s, poll_s)

    def close(self) -> None:
        if self._sub is not None:
            self._sub.close()
        self.r.close()

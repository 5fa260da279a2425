"""The Redis connection every ``redis://`` transport opens (the rollout store,
the weight store, the replay buffer): redis-py is an optional dependency, so it
is imported here, on first use, with a one-line error naming the extra."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from phalanx.transport.base import TransportError


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

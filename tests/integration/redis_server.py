"""A real ``redis-server`` for the tests: its own process group, a free port,
persistence off, killed by its pid at teardown (never by name).

    from redis_server import redis_url  # noqa: F401  (a module-scoped pytest fixture)

    def test_x(redis_url):
        store = RedisRolloutStore(redis_url, "test_x-<unique>")

Tests keep apart by key prefix (a unique job name each), not by flushing.
Where ``redis-server`` is missing, the tests that use the fixture skip with
the reason; ``make install`` installs it where it can (root and apt-get).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.net import free_port

REDIS_SERVER = shutil.which("redis-server")
MISSING = (
    "redis-server is not installed, so the Redis transport tests cannot run: `make install` "
    "installs it with apt-get when run as root; else `apt-get install -y redis-server` (or put "
    "a redis-server binary on PATH)."
)


def serve_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """Start a server; returns (process, ``redis://127.0.0.1:<port>/0``)."""
    assert REDIS_SERVER is not None, MISSING
    import redis

    workdir.mkdir(parents=True, exist_ok=True)
    for _ in range(3):  # another process may grab the port between the probe and the bind
        port = free_port()
        log = open(workdir / f"redis-{port}.log", "wb")  # noqa: SIM115 (the server owns it)
        p = subprocess.Popen(
            [
                REDIS_SERVER,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
                "--protected-mode",
                "no",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 10
        while p.poll() is None and time.monotonic() < deadline:
            try:
                redis.Redis(port=port, socket_connect_timeout=0.5).ping()
                return p, f"redis://127.0.0.1:{port}/0"
            except redis.ConnectionError:
                time.sleep(0.05)
        stop(p)
    raise RuntimeError(f"redis-server did not start: see {workdir}")


def stop(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    p.wait(10)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if REDIS_SERVER is None:
        pytest.skip(MISSING)
    p, url = serve_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield url
    finally:
        stop(p)

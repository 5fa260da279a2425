"""A real local S3-compatible server for the tests: moto's server
(``python -m moto.server``) as a subprocess on a port the OS picks, reached
through s3fs exactly as a job reaches real S3.

Use the module-scoped fixture (one server shared by a test module)::

    from s3 import s3_server  # noqa: F401  (a pytest fixture)

    def test_x(s3_server):
        url, storage_options = s3_server.sub("test_x")

or wrap :func:`serve_s3` in a fixture of your own. Each test should work under
its own prefix (``S3Root.sub``) of the shared bucket.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest

START_TIMEOUT_S = 30.0
BUCKET = "phalanx-test"
RUNNING = re.compile(rb"Running on http://127\.0\.0\.1:(\d+)")


class S3Root(NamedTuple):
    """``(url, storage_options)`` of a prefix in the test bucket; unpacks as a pair."""

    url: str
    storage_options: dict[str, Any]

    @property
    def endpoint(self) -> str:
        return str(self.storage_options["client_kwargs"]["endpoint_url"])

    def sub(self, name: str) -> S3Root:
        """A fresh prefix under this one (unique per call)."""
        return S3Root(f"{self.url}/{name}-{uuid.uuid4().hex[:8]}", self.storage_options)


def storage_options(endpoint: str) -> dict[str, Any]:
    """s3fs options for moto: any credentials work (no region: S3 defaults to us-east-1)."""
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint},
    }


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)  # its own session: the group is its pid
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


@contextlib.contextmanager
def serve_s3(bucket: str = BUCKET) -> Iterator[S3Root]:
    """Start ``python -m moto.server`` on 127.0.0.1, port 0 (it prints the port
    it got), wait until it answers, create ``bucket``; yield its root; stop the
    server by its process group at exit."""
    import fsspec

    with tempfile.TemporaryDirectory(prefix="phalanx-moto-") as tmp:
        log_path = Path(tmp) / "moto.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for k in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
            env.pop(k, None)
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).with_name("moto_server.py")),
                    "-H",
                    "127.0.0.1",
                    "-p",
                    "0",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        try:
            endpoint = _wait_ready(proc, log_path)
            opts = storage_options(endpoint)
            fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
            fs.mkdir(bucket)
            yield S3Root(f"s3://{bucket}", opts)
        finally:
            _stop(proc)


def _wait_ready(proc: subprocess.Popen[bytes], log_path: Path) -> str:
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_S
    endpoint = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"moto server must keep running: it exited with {proc.returncode}. "
                f"Its output:\n{log_path.read_text(errors='replace')[-2000:]}"
            )
        if endpoint is None:
            m = RUNNING.search(log_path.read_bytes())
            if m:
                endpoint = f"http://127.0.0.1:{int(m.group(1))}"
        if endpoint is not None:
            with contextlib.suppress(httpx.HTTPError):
                httpx.get(f"{endpoint}/moto-api/", timeout=1.0)
                return endpoint
        time.sleep(0.05)
    _stop(proc)
    raise RuntimeError(
        f"moto server must answer within {START_TIMEOUT_S} s: it did not. Its output:\n"
        f"{log_path.read_text(errors='replace')[-2000:]}\nIs moto[server] installed "
        f"(pip install -c constraints.txt -e '.[dev]')?"
    )


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3Root]:
    """One moto server per test module; ``.sub(name)`` gives each test its own prefix."""
    with serve_s3() as root:
        yield root

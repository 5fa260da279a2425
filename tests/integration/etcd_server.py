"""A real ``etcd`` for the tests (Debian's etcd-server): its own process group, free
client and peer ports, a temporary data dir, killed by its pid at teardown (never by
name).

    from etcd_server import etcd  # noqa: F401  (a module-scoped pytest fixture)

    def test_x(etcd):
        url = etcd.url("/test_x")  # etcd://127.0.0.1:<port>/test_x

Tests keep apart by key prefix (one each), not by wiping. Where ``etcd`` is missing,
the tests that use the fixture skip with the reason; ``make install`` installs it
where it can (root and apt-get). :func:`start_cluster` starts several members that
form one cluster (a quorum to lose).
"""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from phalanx.launch.controllers.etcd import etcd_argv
from phalanx.net import free_port

ETCD = shutil.which("etcd")
MISSING = (
    "etcd is not installed, so the etcd journal tests cannot run: `make install` installs "
    "Debian's etcd-server with apt-get when run as root; else `apt-get install -y "
    "etcd-server` (or put an etcd binary on PATH)."
)


@dataclass(frozen=True)
class TLS:
    """A member's TLS: its certificate and key, the CA it trusts for clients, and a
    client certificate the CA signed (for its health checks here)."""

    cert: Path
    key: Path
    ca: Path
    client_cert: Path
    client_key: Path


class Member:
    """One etcd process."""

    def __init__(
        self,
        name: str,
        client: int,
        peer: int,
        workdir: Path,
        host: Any = None,
        tls: TLS | None = None,
    ):
        """``host``: a :class:`netns.Host` to run on (listening on its address), or
        None: this machine, on loopback. ``tls``: serve its clients over TLS, asking
        each for a certificate the CA signed."""
        self.name, self.client, self.peer = name, client, peer
        self.host, self.tls = host, tls
        self.ip = host.ip if host is not None else "127.0.0.1"
        self.data = workdir / f"{name}.data"
        self.log = workdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, cluster: str, state: str = "new") -> None:
        """Start (or restart, on its data dir) this member of ``cluster``."""
        assert ETCD is not None, MISSING
        # The launcher's command line (history compacted, as deployments do).
        args = etcd_argv(
            ETCD, self.name, self.data, self.client, self.peer, cluster, host=self.ip, state=state
        )
        if self.tls is not None:
            cert, key, ca = self.tls.cert, self.tls.key, self.tls.ca
            plain = f"http://{self.ip}:{self.client}"
            args = [a.replace(plain, f"https://{self.ip}:{self.client}") for a in args]
            args += ["--cert-file", str(cert), "--key-file", str(key)]
            args += ["--trusted-ca-file", str(ca), "--client-cert-auth"]
        if self.host is not None:
            args = self.host.wrap(args)
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                args,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def healthy(self) -> bool:
        try:
            if self.tls is None:
                r = httpx.get(f"http://{self.ip}:{self.client}/health", timeout=1.0)
            else:
                url = f"https://{self.ip}:{self.client}/health"
                t = self.tls
                ctx = ssl.create_default_context(cafile=str(t.ca))
                ctx.load_cert_chain(str(t.client_cert), str(t.client_key))
                r = httpx.get(url, timeout=1.0, verify=ctx)
            return r.status_code == 200 and r.json().get("health") == "true"
        except (httpx.HTTPError, ValueError):
            return False

    def signal(self, sig: int) -> None:
        """SIGSTOP/SIGCONT/SIGKILL, to its process group."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)  # works on a stopped one too
            self.proc.wait(10)


class Cluster:
    """Members of one etcd cluster; :meth:`url` names all their endpoints."""

    def __init__(self, members: list[Member]):
        self.members = members
        self.spec = ",".join(f"{m.name}=http://{m.ip}:{m.peer}" for m in members)
        """``--initial-cluster``: every member's name and peer URL."""

    @property
    def member(self) -> Member:
        return self.members[0]

    def url(self, prefix: str = "") -> str:
        hosts = ",".join(f"{m.ip}:{m.client}" for m in self.members)
        scheme = "etcds" if self.members[0].tls is not None else "etcd"
        return f"{scheme}://{hosts}{prefix}"

    def wait_healthy(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not all(m.healthy() for m in self.members):
            for m in self.members:
                if m.proc is not None and m.proc.poll() is not None:
                    raise RuntimeError(f"etcd {m.name} exited: {m.log.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not become healthy in {timeout} s")
            time.sleep(0.05)

    def stop(self) -> None:
        for m in self.members:
            m.stop()


def start_cluster(workdir: Path, n: int = 1, hosts: list[Any] | None = None) -> Cluster:
    """Start ``n`` members (ports picked free; tried again if one was taken meanwhile),
    member i on ``hosts[i]`` (:class:`netns.Host`) where given, else on loopback."""
    workdir.mkdir(parents=True, exist_ok=True)
    on = hosts or [None] * n
    for attempt in range(3):
        members = [
            Member(f"m{i}a{attempt}", free_port(), free_port(), workdir, on[i]) for i in range(n)
        ]
        c = Cluster(members)
        for m in members:
            m.start(c.spec)
        try:
            c.wait_healthy()
            return c
        except RuntimeError:
            c.stop()
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if ETCD is None:
        pytest.skip(MISSING)
    c = start_cluster(tmp_path_factory.mktemp("etcd"))
    try:
        yield c
    finally:
        c.stop()

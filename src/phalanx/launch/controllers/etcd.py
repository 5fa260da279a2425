"""A local etcd for the controllers' journal (``phalanx run --journal etcd``): one
member on loopback, on free ports, its data in the run dir, started in a process
group of its own and stopped by it.

One member survives a controller's death (a standby takes over from it), not the
machine's: the run is on one machine anyway. For a journal that survives a host,
name an etcd cluster of yours (``--journal etcd://HOST:2379,...``).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx

from phalanx.launch.procs import last_line, spawn, stop_all
from phalanx.net import LOOPBACK, free_port

START_TIMEOUT_S = 30.0
"""How long a local etcd gets to answer ``/health``."""
MISSING = (
    "--journal etcd runs a local etcd: no `etcd` on PATH. Install it (`apt-get install "
    "etcd-server`, which `make install` does as root), or name yours with --journal "
    "etcd://HOST:2379."
)


def etcd_argv(
    binary: str,
    name: str,
    data_dir: Path,
    client: int,
    peer: int,
    cluster: str,
    *,
    host: str = LOOPBACK,
    state: str = "new",
) -> list[str]:
    """The command line of one etcd member listening on ``host``'s ``client`` and
    ``peer`` ports, in the cluster ``cluster`` (``name=http://host:peer,...``).
    History is compacted (revision mode, the last 1,000 kept), as a deployment
    should: the journal rewrites its keys at every tick."""
    return [
        binary,
        "--name",
        name,
        "--data-dir",
        str(data_dir),
        "--listen-client-urls",
        f"http://{host}:{client}",
        "--advertise-client-urls",
        f"http://{host}:{client}",
        "--listen-peer-urls",
        f"http://{host}:{peer}",
        "--initial-advertise-peer-urls",
        f"http://{host}:{peer}",
        "--initial-cluster",
        cluster,
        "--initial-cluster-state",
        state,
        "--auto-compaction-mode",
        "revision",
        "--auto-compaction-retention",
        "1000",
    ]


class EtcdDown(RuntimeError):
    """The local etcd did not start (the message says why, in one line)."""


class LocalEtcd:
    """Who calls: the launcher's thread. :meth:`start` once, :meth:`stop` at the end
    (also after a failed start)."""

    def __init__(self, run_dir: Path):
        self.dir = run_dir / "etcd"
        self.log = run_dir / "etcd.log"
        self.client = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The journal URL of this etcd (``etcd://127.0.0.1:PORT``)."""
        return f"etcd://{LOOPBACK}:{self.client}"

    def start(self) -> str:
        """Start the member and wait until it is healthy; returns :attr:`url`.
        Raises :class:`EtcdDown` when it is missing, exits or does not answer."""
        binary = shutil.which("etcd")
        if binary is None:
            raise EtcdDown(MISSING)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.client, peer = free_port(), free_port()
        cluster = f"phalanx=http://{LOOPBACK}:{peer}"
        argv = etcd_argv(binary, "phalanx", self.dir / "data", self.client, peer, cluster)
        self.proc = spawn(argv, self.log)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.healthy():
            if self.proc.poll() is not None:
                raise EtcdDown(
                    f"the local etcd exited with {self.proc.returncode} at its start: "
                    f"{last_line(self.log, '(no output)')} (log: {self.log})"
                )
            if time.monotonic() > deadline:
                raise EtcdDown(
                    f"the local etcd did not answer within {START_TIMEOUT_S:.0f} s; see {self.log}"
                )
            time.sleep(0.05)
        return self.url

    def healthy(self) -> bool:
        try:
            r = httpx.get(f"http://{LOOPBACK}:{self.client}/health", timeout=1.0)
            return r.status_code == 200 and r.json().get("health") == "true"
        except (httpx.HTTPError, ValueError):
            return False

    def stop(self) -> None:
        stop_all([self.proc])

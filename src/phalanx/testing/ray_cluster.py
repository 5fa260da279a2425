"""A Ray cluster of separate nodes on this host, for tests and benchmarks: a head
and workers, each started with ``ray start --block`` in a session of its own, on
free ports and a temp dir of its own, so that nothing is shared with another
Ray instance on the machine. Given hosts of :mod:`phalanx.testing.netns`, each
node runs on its own host (its network namespace and address): the nodes then
reach each other only over the test's switch, as machines do. A driver runs on
the head's host (:meth:`Cluster.wrap`).

A node is stopped through its own process group (SIGTERM, then SIGKILL), never
by name and never with ``ray stop`` (which stops every Ray on the host). A
node is *lost* by SIGKILLing its raylet by pid: ``ray start --block`` then
takes its node's other processes down, as a machine that dies would.

The GCS marks a node dead after ``health_check_failure_threshold`` failed
checks, ``health_check_period_ms`` apart; :data:`FAST_HEALTH` makes that about
1.5 s instead of Ray's default 15 s and more, so that a test waits on events
rather than on Ray's timeouts. Token authentication is off
(``RAY_AUTH_MODE=disabled``): these nodes listen on this host only, and a
token in ``~/.ray`` belongs to whoever made it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from phalanx.net import free_port

if TYPE_CHECKING:
    from phalanx.testing.netns import Host

FAST_HEALTH = {
    "RAY_health_check_initial_delay_ms": "0",
    "RAY_health_check_period_ms": "500",
    "RAY_health_check_timeout_ms": "500",
    "RAY_health_check_failure_threshold": "3",
}
RAY_ENV = {"RAY_AUTH_MODE": "disabled", **FAST_HEALTH}
"""The environment of the nodes, and of every driver that joins them."""
START_TRIES = 3
"""A node that exits while it starts (its raylet missed Ray's 30 s to register,
on a busy host) is started again, up to this many tries in all."""
START_S = 180.0
"""How long a node may take to start (Ray on a loaded 2-core host: 10-25 s)."""


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


@dataclass
class Node:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    cpus: int = 0
    args: tuple[str, ...] = ()
    tries: int = 1
    host: Host | None = None
    """The namespace host the node runs on (None: this host's own network)."""

    def raylet_pid(self) -> int | None:
        """The pid of this node's raylet (a child of ``ray start``), or None."""
        import psutil

        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return None
        return next((k.pid for k in kids if _name(k) == "raylet"), None)

    def hosts(self, needle: str) -> list[int]:
        """Pids of processes under this node whose command line contains ``needle``
        (the replicas its actors run)."""
        import psutil

        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        out = []
        for k in kids:
            try:
                if needle in " ".join(k.cmdline()):
                    out.append(k.pid)
            except psutil.Error:
                continue
        return out

    def lose(self) -> int:
        """SIGKILL the raylet (the node is lost); returns its pid."""
        pid = self.raylet_pid()
        if pid is None:
            raise RuntimeError(f"ray node {self.name} has no raylet to kill; see {self.log}")
        os.kill(pid, signal.SIGKILL)
        return pid

    def stop(self, grace_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            _killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        _killpg(self.proc.pid, signal.SIGKILL)  # whatever it left in its group
        self.proc.wait()


def _tail(log: Path, lines: int = 15) -> str:
    """The last lines of a node's log, for an error that CI prints (the log itself
    is gone with CI's machine)."""
    try:
        text = log.read_text(errors="replace").splitlines()[-lines:]
    except OSError as e:
        return f"{log}: {e}"
    return f"{log} ends with:\n" + "\n".join(text)


def _name(p: object) -> str:
    try:
        return str(p.name())  # type: ignore[attr-defined]
    except Exception:
        return ""


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


class Cluster:
    """A head node (``head_cpus`` CPUs) and workers added with :meth:`add_worker`;
    :attr:`address` is the head's GCS, for ``--ray-address``. Close it (or use
    ``with``) to stop every node."""

    def __init__(self, root: Path, head_cpus: int = 2, host: Host | None = None):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.nodes: list[Node] = []
        self.address = ""
        # Ray's session dir holds AF_UNIX sockets, whose paths must stay under 108
        # bytes: a pytest tmp dir can be longer than that leaves room for.
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        for tries in range(1, START_TRIES + 1):
            # ``ray start --block`` exits 1 when any process it started dies while
            # the node comes up (an agent that misses its time to register on a
            # busy host, a free port taken meanwhile): start again on fresh ports.
            self.port = free_port()
            args = ["--head", f"--port={self.port}", f"--ray-client-server-port={free_port()}"]
            args += ["--include-dashboard=false", f"--temp-dir={self.temp_dir}"]
            head = self._start("head", head_cpus, args, host)
            head.tries = tries
            try:
                self.address = f"{self._head_ip(head)}:{self.port}"
                return
            except RuntimeError:
                head.stop(grace_s=5.0)
                self.nodes.remove(head)
                if tries == START_TRIES:
                    shutil.rmtree(self.temp_dir, ignore_errors=True)
                    raise
                head.log.rename(head.log.with_suffix(f".try{tries}.log"))

    def env(self) -> dict[str, str]:
        return {**os.environ, **RAY_ENV}

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` run where a driver of this cluster runs: on the head's host."""
        host = self.nodes[0].host if self.nodes else None
        return host.wrap(cmd) if host is not None else cmd

    def _start(self, name: str, cpus: int, args: list[str], host: Host | None = None) -> Node:
        log = self.root / f"{name}.log"
        ports = [
            f"--node-manager-port={free_port()}",
            f"--object-manager-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
        ]
        cmd = [_ray_bin(), "start", "--block", f"--num-cpus={cpus}", "--disable-usage-stats"]
        cmd += ["--object-store-memory=80000000", *ports, *args]
        if host is not None:
            cmd = host.wrap([*cmd, f"--node-ip-address={host.ip}"])
        with log.open("wb") as f:
            proc = subprocess.Popen(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env(),
                start_new_session=True,
            )
        node = Node(name, proc, log, cpus, tuple(args), host=host)
        self.nodes.append(node)
        return node

    def _head_ip(self, head: Node) -> str:
        """The head's address, from its log once its GCS is up."""
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if head.proc.poll() is not None:
                raise RuntimeError(
                    f"ray head exited with {head.proc.returncode} (try {head.tries} of"
                    f" {START_TRIES}): {_tail(head.log)}"
                )
            for line in head.log.read_text(errors="replace").splitlines():
                if "ray start --address=" in line:
                    return line.split("--address=")[1].strip("'\" ").rsplit(":", 1)[0]
            time.sleep(0.2)
        raise RuntimeError(f"ray head did not start within {START_S:.0f} s: {_tail(head.log)}")

    def add_worker(self, cpus: int, host: Host | None = None) -> Node:
        name = f"worker{len(self.nodes)}"
        return self._start(name, cpus, [f"--address={self.address}"], host)

    def wait_nodes(self, n: int, timeout_s: float = START_S) -> None:
        """Wait until ``n`` nodes have a raylet that registered with the head (its log
        says so), each node's ``ray start`` still running."""
        deadline = time.monotonic() + timeout_s
        while True:
            for i, node in enumerate(self.nodes):
                if node.proc.poll() is None:
                    continue
                if node.name != "head" and node.tries < START_TRIES:
                    # Ray gives a raylet a fixed 30 s to register, and a worker's start
                    # a fixed time to reach the GCS: a busy host can miss either.
                    self.nodes.pop(i)
                    node.log.rename(node.log.with_suffix(f".try{node.tries}.log"))
                    again = self._start(node.name, node.cpus, list(node.args), node.host)
                    again.tries = node.tries + 1
                    break
                raise RuntimeError(
                    f"ray node {node.name} exited with {node.proc.returncode}: {_tail(node.log)}"
                )
            up = [
                x for x in self.nodes if "Ray runtime started" in x.log.read_text(errors="replace")
            ]
            if len(up) >= n:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(up)} of {n} ray nodes started within {timeout_s:.0f} s")
            time.sleep(0.2)

    def close(self, grace_s: float = 15.0) -> None:
        for node in reversed(self.nodes):
            node.stop(grace_s)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

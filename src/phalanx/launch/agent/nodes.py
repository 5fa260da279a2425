"""A replica across nodes under the agent: one ``phalanx agent`` per node, each
with ``--nnodes N --node-rank K --master-addr HOST[:PORT]`` and ``--nproc``
workers, the replica's ranks ``K * nproc + LOCAL_RANK`` of ``N * nproc``.

The ranks of one generation meet at their rank 0's store (``MASTER_ADDR``,
``MASTER_PORT``), which rank 0 serves on a fresh port each generation, so that
a restarted generation never meets a broken one's store. Node 0's agent (the
*leader*) runs the generations: it picks each one's port, starts it, counts
restarts. The other agents (*followers*) ask it which generation runs on
which port, start their workers for it, and tell it when one of theirs fails.
That is this module: a small HTTP/JSON service the leader serves at
``HOST:PORT`` (an address of node 0 that the others reach), and its client.
It carries no code and no tensors: a generation, a port, a state, a reason.

- ``GET /v1/rdzv?replica=NAME&node=K&nproc=P&nnodes=N``: the current
  :class:`Round`; 409 with one line when the asker's replica, ``nnodes`` or
  ``nproc`` differ from the leader's (a misconfigured node is refused, not
  mixed in).
- ``POST /v1/rdzv/fail`` ``{"replica", "node", "generation", "reason",
  "unrecoverable"}``: a follower's worker failed in that generation. The
  leader stops its own workers and starts the next generation (or gives up,
  past ``--max-restarts`` or for a worker that cannot run); the followers see
  the new generation and restart theirs: the replica fails, and restarts,
  together.

Why the leader agent rather than the controller: the ranks of a replica must
meet before the replica exists at the controller (rank 0 registers it once
they have), the controller's members are replicas rather than nodes, and a
controller restart or a partition from it must not restart a replica that
trains. It is torchrun's static rendezvous on node 0 (``--master-addr``), with
the generation said explicitly.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from phalanx.net import hostport

DEFAULT_PORT = 29400
"""The leader's port when ``--master-addr`` names none (torchrun's rendezvous port)."""
POLL_S = 0.1
"""How often a follower asks the leader."""
ASK_S = 2.0
"""How long one question to the leader may take."""


class NodeError(RuntimeError):
    """The replica's nodes cannot work together; the message is one line."""


@dataclass
class Round:
    """The leader's word: which generation runs, and where its rank 0's store is."""

    generation: int = -1
    """-1: none started yet."""
    port: int = 0
    """``MASTER_PORT`` of the generation (on the leader's host)."""
    state: str = "starting"
    """``starting``, ``running``, or the leader's end: ``done``, ``failed``, ``stopped``."""
    reason: str = ""

    @property
    def ended(self) -> bool:
        return self.state in ("done", "failed", "stopped")


@dataclass(frozen=True)
class Failure:
    """A follower's report of a failed worker."""

    node: int
    generation: int
    reason: str
    unrecoverable: bool


class Leader:
    """Node rank 0's side: serves the rendezvous on ``host:port`` from a thread of
    its own. Who calls: the leader agent, from its main loop (:meth:`publish`,
    :meth:`failure`, :meth:`end`). Raises :class:`NodeError` when it cannot listen."""

    def __init__(self, name: str, nnodes: int, nproc: int, host: str, port: int):
        self.name, self.nnodes, self.nproc = name, nnodes, nproc
        self.round = Round()
        self._lock = threading.Lock()
        self._failures: list[Failure] = []
        self._seen: dict[int, int] = {}
        """Follower -> the number of the last change of :attr:`round` it was told."""
        self._changes = 0
        try:
            self.server = ThreadingHTTPServer((host, port), _handler(self))
        except OSError as e:
            raise NodeError(
                f"--master-addr must be an address of node rank 0's host, with a free port: "
                f"listening on {hostport(host, port)} failed ({e.strerror}). Pass this host's "
                f"address, or another port."
            ) from None
        self.server.daemon_threads = True
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="phalanx-rdzv", daemon=True
        )
        self._thread.start()

    def publish(self, generation: int, port: int) -> None:
        """Generation ``generation`` runs, its store on ``port``."""
        with self._lock:
            self.round = Round(generation, port, "running")
            self._changes += 1

    def failure(self) -> Failure | None:
        """A follower's report of a failure in the current generation, taken once;
        reports of older generations are dropped (that generation is gone)."""
        with self._lock:
            now = [f for f in self._failures if f.generation == self.round.generation]
            self._failures.clear()
        return now[0] if now else None

    def end(self, state: str, reason: str = "", linger_s: float = 2.0) -> None:
        """Say the leader's end (``done``, ``failed``, ``stopped``), wait up to
        ``linger_s`` until every follower has been told, then stop serving."""
        with self._lock:
            self.round = Round(self.round.generation, self.round.port, state, reason)
            self._changes += 1
            change = self._changes
        deadline = time.monotonic() + linger_s
        while time.monotonic() < deadline:
            with self._lock:
                told = sum(1 for c in self._seen.values() if c >= change)
            if told >= self.nnodes - 1:
                break
            time.sleep(POLL_S / 2)
        self.close()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    # -- requests (the server's threads) ---------------------------------

    def answer(self, query: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        problem = self._mismatch(query)
        if problem:
            return 409, {"error": problem}
        with self._lock:
            self._seen[int(query["node"])] = self._changes
            return 200, asdict(self.round)

    def take_failure(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        problem = self._mismatch(body, full=False)
        if problem:
            return 409, {"error": problem}
        f = Failure(
            int(body["node"]),
            int(body["generation"]),
            str(body.get("reason", ""))[:500],
            bool(body.get("unrecoverable")),
        )
        with self._lock:
            self._failures.append(f)
            return 200, asdict(self.round)

    def _mismatch(self, q: dict[str, Any], full: bool = True) -> str | None:
        try:
            node = int(q["node"])
            theirs = (str(q["replica"]), int(q["nnodes"]), int(q["nproc"])) if full else None
        except (KeyError, ValueError, TypeError):
            return "a rendezvous request must name replica, node, nnodes and nproc"
        if str(q.get("replica")) != self.name:
            return (
                f"the agents of one replica must share --name: node {node} has "
                f"{q.get('replica')!r}, node rank 0 has {self.name!r}. Fix --name or --master-addr."
            )
        if not 0 < node < self.nnodes:
            return (
                f"--node-rank must be in [1, {self.nnodes}) for a follower of this replica: "
                f"got {node}."
            )
        if theirs is not None and theirs[1:] != (self.nnodes, self.nproc):
            return (
                f"every agent of a replica must have the same --nnodes and --nproc: node {node} "
                f"has --nnodes {theirs[1]} --nproc {theirs[2]}, node rank 0 has --nnodes "
                f"{self.nnodes} --nproc {self.nproc}."
            )
        return None


def _handler(leader: Leader) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            if url.path != "/v1/rdzv":
                return self._reply(404, {"error": f"no route {url.path}"})
            query = {k: v[0] for k, v in urllib.parse.parse_qs(url.query).items()}
            self._reply(*leader.answer(query))

        def do_POST(self) -> None:
            if self.path != "/v1/rdzv/fail":
                return self._reply(404, {"error": f"no route {self.path}"})
            n = int(self.headers.get("Content-Length") or 0)
            try:
                body = json.loads(self.rfile.read(min(n, 1 << 16)))
            except ValueError:
                return self._reply(400, {"error": "the body must be JSON"})
            if not isinstance(body, dict):
                return self._reply(400, {"error": "the body must be a JSON object"})
            self._reply(*leader.take_failure(body))

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: the agent says what matters in its own events."""

    return Handler


class Follower:
    """Node rank K's side (K > 0): asks the leader at ``host:port``."""

    def __init__(
        self, name: str, nnodes: int, nproc: int, node_rank: int, host: str, port: int
    ) -> None:
        self.base = f"http://{hostport(host, port)}"
        self.ids = {"replica": name, "node": node_rank, "nnodes": nnodes, "nproc": nproc}
        self.last_error = ""

    def ask(self) -> Round | None:
        """The leader's round; None when it cannot be reached now. Raises
        :class:`NodeError` when the leader refuses this node (a mismatch)."""
        url = f"{self.base}/v1/rdzv?{urllib.parse.urlencode(self.ids)}"
        return self._call(urllib.request.Request(url))

    def report(self, generation: int, reason: str, unrecoverable: bool) -> None:
        """Tell the leader a worker here failed in ``generation`` (best effort: a
        leader that cannot be reached finds out from its own ranks)."""
        body = json.dumps(
            {**self.ids, "generation": generation, "reason": reason, "unrecoverable": unrecoverable}
        ).encode()
        req = urllib.request.Request(
            f"{self.base}/v1/rdzv/fail", body, {"Content-Type": "application/json"}
        )
        self._call(req)

    def _call(self, req: urllib.request.Request) -> Round | None:
        try:
            with urllib.request.urlopen(req, timeout=ASK_S) as r:
                return Round(**json.loads(r.read()))
        except urllib.error.HTTPError as e:
            if e.code == 409:
                raise NodeError(json.loads(e.read()).get("error", "refused")) from None
            self.last_error = f"HTTP {e.code}"
        except (OSError, ValueError, TypeError) as e:
            self.last_error = str(getattr(e, "reason", e))
        return None

    def wait(self, after: int, timeout_s: float, stopped: Callable[[], bool]) -> Round | None:
        """Wait for a generation newer than ``after`` (or the leader's end). None
        when ``stopped()`` turns true first; :class:`NodeError` after ``timeout_s``
        with no such answer."""
        deadline = time.monotonic() + timeout_s
        while not stopped():
            r = self.ask()
            if r is not None and (r.ended or (r.state == "running" and r.generation > after)):
                return r
            if time.monotonic() > deadline:
                why = f"it cannot be reached ({self.last_error})" if r is None else "none started"
                raise NodeError(
                    f"the replica's node rank 0 agent must start a generation within "
                    f"{timeout_s:g} s at {self.base.removeprefix('http://')}: {why}. Start the "
                    f"agent with --node-rank 0 there, or fix --master-addr."
                )
            time.sleep(POLL_S)
        return None


class NodeLink:
    """An agent's place in its replica's nodes: the leader's side, a follower's, or
    neither (a replica on one node: every call is then a no-op). Who calls: the
    agent's main loop. Raises :class:`NodeError` when node 0's agent cannot listen."""

    def __init__(
        self, name: str, nnodes: int, nproc: int, node_rank: int, master: tuple[str, int] | None
    ):
        self.leader: Leader | None = None
        self.follower: Follower | None = None
        if nnodes > 1 and master is not None:
            if node_rank == 0:
                self.leader = Leader(name, nnodes, nproc, *master)
            else:
                self.follower = Follower(name, nnodes, nproc, node_rank, *master)
        self._asked_at = 0.0

    def started(self, generation: int, port: int) -> None:
        """The leader started ``generation``, its store on ``port``: say so."""
        if self.leader is not None:
            self.leader.publish(generation, port)

    def news(self, generation: int) -> Failure | str | None:
        """The leader: a follower's failure report of the current generation. A
        follower: ``"follow"`` once node 0 started a generation newer than
        ``generation`` or ended badly (asked every :data:`POLL_S`)."""
        if self.leader is not None:
            return self.leader.failure()
        if self.follower is None or time.monotonic() < self._asked_at + POLL_S:
            return None
        self._asked_at = time.monotonic()
        r = self.follower.ask()
        if r is not None and (r.generation > generation or r.state in ("failed", "stopped")):
            return "follow"
        return None

    def end(self, code: int, reason: str) -> None:
        """The leader's agent exits with ``code``: tell the followers how it ended."""
        if self.leader is not None:
            self.leader.end({0: "done", 1: "failed"}.get(code, "stopped"), reason)

"""The serverless executor interface: start replicas somewhere, watch them, read
their logs, stop them.

A *replica* here is one run of a ``phalanx`` CLI command (``phalanx replica
--config job.toml --name r0``, say), and the executor is generic over which
command: it knows nothing of jobs, roles or controllers. The launcher picks an
executor from config and drives it:

1. :meth:`ServerlessExecutor.launch_replicas` once per batch of new replicas;
2. :meth:`~ServerlessExecutor.poll` and :meth:`~ServerlessExecutor.stream_logs`
   on its own period, to notice ends and follow output;
3. :meth:`~ServerlessExecutor.launch_replicas` again (or
   :meth:`~ServerlessExecutor.relaunch`) with the name of a replica that ended,
   to restart it;
4. :meth:`~ServerlessExecutor.cancel` for a scale-down,
   :meth:`~ServerlessExecutor.collect` to wait for the end, and
   :meth:`~ServerlessExecutor.close` (or ``with``) on the way out.

Implementations: :class:`phalanx.launch.local_executor.LocalProcessExecutor`
(the embedded default: local processes) and
:class:`phalanx.launch.ray_executor.RayExecutor` (Ray actors). This module
imports neither Ray nor torch, so that ``phalanx --help`` stays fast.
"""

from __future__ import annotations

import enum
import re
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")
"""What a replica name may be: it names log files and Ray actors."""


@dataclass(frozen=True)
class ReplicaSpec:
    """What to run for one replica: ``phalanx <argv>`` with ``env`` added to the
    environment, in ``cwd``."""

    name: str
    """Unique among the executor's live replicas; letters, digits, ``_ . -``."""
    argv: list[str]
    """Arguments of the ``phalanx`` CLI, without ``phalanx`` itself, e.g.
    ``["replica", "--config", "job.toml", "--name", "r0"]``."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables set for this replica on top of the executor's own."""
    cwd: str | None = None
    """Working directory; ``None`` keeps the executor's default (see each executor)."""
    ranks: int = 1
    """Processes the replica spans (``[replica] ranks``): more than 1 runs the command
    under :mod:`phalanx.launch.ranks`, its ranks together on one node, and the
    executor reserves resources for each of them."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME_RE.fullmatch(self.name):
            raise ValueError(
                f"replica name must match {NAME_RE.pattern}: got {self.name!r}. Use letters, "
                f"digits, '_', '.' and '-' only."
            )
        if isinstance(self.argv, str) or not all(isinstance(a, str) for a in self.argv):
            raise ValueError(
                f"replica {self.name}: argv must be a list of strings (the phalanx CLI's "
                f"arguments): got {self.argv!r}."
            )
        if not isinstance(self.ranks, int) or self.ranks < 1:
            raise ValueError(f"replica {self.name}: ranks must be an int >= 1: got {self.ranks!r}.")
        bad = {
            k: v for k, v in self.env.items() if not isinstance(k, str) or not isinstance(v, str)
        }
        if bad:
            raise ValueError(f"replica {self.name}: env must map str to str: got {bad!r}.")
        # Own copies: a caller that mutates its list later must not change a launched spec.
        object.__setattr__(self, "argv", list(self.argv))
        object.__setattr__(self, "env", dict(self.env))


class ReplicaState(enum.StrEnum):
    PENDING = "pending"
    """Launched, but not running yet (e.g. a Ray actor waiting for resources)."""
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    """Exited with code 0."""
    FAILED = "failed"
    """Exited non-zero, was killed by someone else than the executor, or its
    worker died; ``error`` says which."""
    CANCELLED = "cancelled"
    """Stopped by :meth:`ServerlessExecutor.cancel` or ``close``."""

    @property
    def ended(self) -> bool:
        """Succeeded, failed or cancelled: it runs no more."""
        return self in ENDED


ENDED = frozenset({ReplicaState.SUCCEEDED, ReplicaState.FAILED, ReplicaState.CANCELLED})


@dataclass(frozen=True)
class ReplicaStatus:
    """One replica's latest launch, as :meth:`ServerlessExecutor.poll` last saw it."""

    name: str
    state: ReplicaState
    exit_code: int | None = None
    """The command's exit code once it ended; negative for a signal (local);
    ``None`` while running, or when there is none (a Ray actor that died or was killed)."""
    started_at: float | None = None
    """Wall-clock time (``time.time()``) it started running; ``None`` while pending."""
    ended_at: float | None = None
    """Wall-clock time the executor saw it end."""
    error: str | None = None
    """Why it failed, in words; ``None`` unless failed or cancelled."""
    attempt: int = 0
    """0 for the first launch of this name, then 1, 2, ... for each relaunch."""

    @property
    def ended(self) -> bool:
        return self.state.ended


def describe_exit(code: int) -> str:
    """``exited with code 3`` or ``killed by signal 9 (SIGKILL)`` for a Popen returncode."""
    if code >= 0:
        return f"exited with code {code}"
    import signal

    try:
        name = signal.Signals(-code).name
    except ValueError:
        name = "?"
    return f"killed by signal {-code} ({name})"


class ServerlessExecutor(ABC):
    """Runs replicas (``phalanx`` CLI commands) on some backend; see the module doc.

    Every method may be called from any thread: an implementation guards its
    state with a lock, which it does not hold while it waits out a grace period
    (so :meth:`poll` answers while :meth:`cancel` waits); remote backends may
    hold it for a bounded remote call (seconds). Nothing here raises because a
    *replica* failed: a replica's failure is a status (``failed``), while an
    error of the executor itself (bad spec, backend unreachable) raises.
    """

    backend_name: str
    """Short name of the backend, as in config: ``local``, ``ray``."""
    supports_inter_replica_network: bool
    """Whether replicas can reach each other over the network (TCP: collectives,
    heal transfers). When False, only jobs whose replicas exchange through object
    storage (decoupled DiLoCo) can run on this executor."""

    poll_interval_s: float = 0.05
    """How often :meth:`collect` polls."""

    @abstractmethod
    def launch_replicas(self, specs: Iterable[ReplicaSpec]) -> list[str]:
        """Start one replica per spec and return their handles (their names).

        Called by the launcher, for the first replicas and for restarts. A name
        may be reused once its replica has ended: the new launch replaces the
        old one's status, counts ``attempt`` up, and its lines follow the old
        ones in the same log after a ``--- relaunch N of NAME ---`` line.
        Raises ``ValueError`` (launching none of them) when a name is given twice
        or names a replica that is still pending or running; raises the
        backend's error when the backend cannot take the replicas at all. A
        replica that starts but then fails to run is a ``failed`` status, not an
        exception."""

    @abstractmethod
    def poll(self) -> dict[str, ReplicaStatus]:
        """The status of every replica launched so far (ended ones included, with
        their final status), by name. Does not block on the replicas; cheap
        enough to call every 50 ms."""

    @abstractmethod
    def stream_logs(self, name: str, since: int = 0) -> tuple[list[str], int]:
        """The replica's output lines (stdout and stderr, interleaved as written,
        without line ends) from line ``since`` on, and the cursor to pass next
        time. Only complete lines are returned while the replica runs; after its
        end, the last partial line too. Works while it runs and after it ended,
        and across relaunches of the same name (a cursor stays valid). Called by
        the launcher to follow or show output; it may wait a few seconds on a
        remote backend. Raises ``KeyError`` for a name never launched."""

    @abstractmethod
    def cancel(self, name: str | None = None) -> None:
        """Stop one replica, or every live one when ``name`` is None; each one
        stopped ends ``cancelled``. A replica that already ended keeps its status.
        Blocks until the replicas are stopped (at most the executor's grace
        period). Raises ``KeyError`` for a name never launched."""

    @abstractmethod
    def close(self) -> None:
        """Cancel every live replica and free the executor's resources. Idempotent;
        the executor cannot launch afterwards."""

    @abstractmethod
    def spec(self, name: str) -> ReplicaSpec:
        """The spec of the latest launch of ``name``. Raises ``KeyError`` if none."""

    # -- built on the above ---------------------------------------------

    def relaunch(self, name: str) -> str:
        """Launch ``name`` again with its latest spec, once it has ended (the
        launcher restarting a failed replica). Raises ``ValueError`` if it still
        runs, ``KeyError`` if it was never launched."""
        return self.launch_replicas([self.spec(name)])[0]

    def collect(self, timeout_s: float | None = None) -> dict[str, ReplicaStatus]:
        """Wait until every replica launched so far has ended, and return their
        statuses. Raises ``TimeoutError`` naming those still live after
        ``timeout_s`` seconds; it does not stop them (call :meth:`cancel`)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            statuses = self.poll()
            live = sorted(n for n, s in statuses.items() if not s.ended)
            if not live:
                return statuses
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.backend_name} executor: replicas must end within {timeout_s} s: "
                    f"still live after it: {', '.join(live)}. Wait longer, or cancel them."
                )
            time.sleep(self.poll_interval_s)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def check_launch(specs: list[ReplicaSpec], live: Iterable[str]) -> None:
    """Refuse a batch that names a replica twice or names a live one (``ValueError``)."""
    counts = Counter(s.name for s in specs)
    twice = sorted(n for n, k in counts.items() if k > 1)
    if twice:
        raise ValueError(
            f"replica names must be unique within a launch: got {', '.join(twice)} more than "
            f"once. Give each replica its own name."
        )
    busy = sorted(set(counts) & set(live))
    if busy:
        raise ValueError(
            f"replica names must not be those of live replicas: {', '.join(busy)} still "
            f"pending or running. Cancel them first, or wait for their end to relaunch them."
        )

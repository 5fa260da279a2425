"""The transport interfaces: rollout stores, weight channels and stores, replay.

- :class:`RolloutStore` keeps an RL job's rollout payloads outside the
  controller, by ref, between the rollout replica that put them and the
  policy replicas that read them (``redis_store.py``, ``storage_store.py``);
  the controller's ledger records the refs. The default is the controller's
  own payload log (no store object: the payloads ride in the submissions).
- :class:`WeightChannel` moves versioned policy weights to rollout replicas
  under the controller's sync orders: a collective broadcast
  (``collective.py``), or a :class:`WeightStore` (``published.py``).
- :class:`WeightStore` keeps published versions: storage (safetensors and an
  atomically replaced manifest, ``storage_weights.py``) or Redis (versioned
  keys and a pointer, ``redis_weights.py``).
- :class:`ReplayBuffer` samples uniformly over the last N rollouts for
  off-policy algorithms (``replay.py``: in memory, Redis).

A *version* is the policy's committed step count whose weights a replica
holds (DESIGN.md). The controller decides *when* weights move (a sync order
after every ``sync_every`` commits, and for joiners); a channel decides *how*.
``factory.py`` picks each backend from the URL in the job's ``[rl.transport]``.
"""

from __future__ import annotations

import random
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Generator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from phalanx.protocol.rl import SyncOrder

if TYPE_CHECKING:
    import torch

    from phalanx.protocol.rl import RolloutPayload

__all__ = ["SyncOrder"]  # the controller's order, as a weight channel takes it


@dataclass
class SyncResult:
    seq: int
    version: int
    ok: bool
    seconds: float
    nbytes: int
    members: int
    error: str = ""


Pairs = Generator[tuple[str, "torch.Tensor"], None, None]
"""A stream of (name, tensor) pairs of one version, as a channel receives them. Run it
to its end or ``close()`` it before the channel's next order."""

Report = Callable[[SyncResult], None]
"""Called once per order with its outcome (from the channel's own thread on the
sending side). It reports to the controller (``ControllerClient.sync_done``)."""


class Sends:
    """A source's sends, one at a time on a thread of their own, newest order first
    in spirit: a send whose order was superseded by a newer one before it began is
    not made, and reported failed at once. A source is handed a new order while its
    last send still runs only when the controller lost track of it (a restarted
    controller orders again); without this, each controller restart queued one more
    send behind the running one, every queued send waited out its receivers, who had
    long moved on to the newer order, and under repeated restarts the source fell
    ever further behind and no sync completed again. The report frees the source on
    a controller that still waits for it, and is ignored as an old sync otherwise."""

    def __init__(self, thread_name: str):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=thread_name)
        self.newest = 0
        """The newest order's ``seq`` handed to :meth:`submit`."""

    def submit(
        self, order: SyncOrder, version: int, send: Callable[[], SyncResult], report: Report
    ) -> Future[SyncResult]:
        self.newest = max(self.newest, order.seq)
        return self._pool.submit(self._run, order, version, send, report)

    def _run(
        self, order: SyncOrder, version: int, send: Callable[[], SyncResult], report: Report
    ) -> SyncResult:
        newest = self.newest
        if order.seq < newest:
            res = SyncResult(
                order.seq,
                version,
                False,
                0.0,
                0,
                len(order.members),
                f"sync {order.seq} was superseded by sync {newest} before it began: not sent",
            )
            report(res)
            return res
        return send()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class WeightChannel(ABC):
    """Moves policy weights to rollout replicas.

    The policy leader calls :meth:`publish` at a step boundary, with the
    committed weights; it returns at once (the weights are snapshotted and
    sent in the background) and the outcome goes to ``report``. A rollout
    replica calls :meth:`fetch` between generation batches; it blocks until
    the weights arrived (or raises :class:`~phalanx.comm.base.CommError`),
    and never leaves the target half-written on error. Or it calls
    :meth:`fetch_stream` and hands the stream to an engine that rolls back a
    stream broken part-way (``GenerationEngine.streamed_updates``).
    """

    pending: Future[SyncResult] | None = None
    """The leader's last send, when it sends from a thread (tests and shutdown wait on it)."""

    @abstractmethod
    def publish(
        self, version: int, weights: Mapping[str, torch.Tensor], order: SyncOrder, report: Report
    ) -> None:
        """Policy leader: serve ``order`` with ``weights`` of ``version``."""

    @abstractmethod
    def fetch(
        self, order: SyncOrder, like: Mapping[str, torch.Tensor]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        """Rollout replica: take part in ``order``; returns (version, weights) with the
        names, shapes and dtypes of ``like``."""

    def fetch_stream(self, order: SyncOrder, like: Mapping[str, torch.Tensor]) -> tuple[int, Pairs]:
        """Rollout replica: as :meth:`fetch`, but the tensors come as a stream, each as
        soon as it is in, so that the engine loads it while the next ones arrive. The
        version is known before the first tensor; a transfer that breaks part-way
        raises CommError from the stream. This default fetches everything first (a
        store's read is one file); the collective channel streams its buckets."""
        version, weights = self.fetch(order, like)
        return version, (pair for pair in weights.items())

    relays = False
    """Whether a rollout replica can serve the weights it last fetched to a later one
    (:meth:`relay`): the rollout-to-rollout broadcast. It advertises this when it
    registers, and only then may the controller name it a sync's source."""

    def relay(self, order: SyncOrder, version: int) -> SyncResult:
        """Rollout replica named rank 0 of ``order``: send the weights of ``version``
        it last fetched to the order's other members (a late joiner), at once."""
        raise NotImplementedError(f"{type(self).__name__} does not relay weights")

    @abstractmethod
    def close(self) -> None:
        """Release the channel's groups and threads."""


class TransportError(RuntimeError):
    """A transport backend failed (server unreachable, storage error)."""


# -- rollout stores -----------------------------------------------------------


def store_name(job_id: str, run: str) -> str:
    """A job's namespace in a rollout store or weight store shared by jobs and reruns:
    the job id and the ledger's run (a rerun's rollout ids start at p0.0 again)."""
    return f"{job_id}.{run}" if run else job_id


def new_ref(rollout_id: str, wall: float | None = None) -> str:
    """A fresh payload ref: the rollout id, the put's wall-clock milliseconds and a
    nonce. Never reused, so a late put of one rollout id never overwrites another
    replica's payload of it; the time lets the orphan sweep age it."""
    ms = int((time.time() if wall is None else wall) * 1000)
    return f"{rollout_id}-{ms}-{uuid.uuid4().hex[:8]}"


def ref_time(ref: str) -> float | None:
    """The wall-clock time a ref was made (None if it is not one of :func:`new_ref`'s)."""
    try:
        return int(ref.rsplit("-", 2)[1]) / 1000
    except (IndexError, ValueError):
        return None


class RolloutStore(ABC):
    r"""Where rollout payloads wait between the rollout replica that made them and
    the policy replicas that train on them, when the store is outside the
    controller (Redis, storage). The controller's ledger records each rollout's
    summary and the ``ref`` its :meth:`put` returned, never the payload.

    - a rollout replica :meth:`put`\ s the payloads of a lease, then submits their
      refs to the ledger;
    - a policy replica :meth:`get`\ s the payloads of its batch by ref, and
      reports to the ledger those it could not read (missing, or corrupt: set
      aside and counted here);
    - the controller's collector :meth:`drop`\ s a payload once its rollout is
      trained or discarded, counted under the reason, and sweeps *orphans*: refs
      no ledger record refers to, older than a few lease deadlines (a replica
      that died between its put and its submit).

    Every method may be called from any process, concurrently. Backend errors
    (a server down) raise :class:`TransportError`.
    """

    @abstractmethod
    def put(self, payloads: Sequence[RolloutPayload]) -> list[str]:
        """Store ``payloads``; returns their refs, in order (fresh ones: :func:`new_ref`)."""

    @abstractmethod
    def get(self, refs: Sequence[str]) -> tuple[dict[str, RolloutPayload], dict[str, str]]:
        """(the payloads found, by ref; the refs not found, with why:
        ``payload_missing`` or ``payload_corrupt``)."""

    @abstractmethod
    def drop(self, refs: Sequence[str], reason: str) -> int:
        """Delete these payloads (idempotent); returns how many were still held.
        ``reason`` is ``trained`` or a discard reason, counted as such."""

    @abstractmethod
    def refs(self) -> list[str]:
        """Every ref held now (the orphan sweep lists them)."""

    @abstractmethod
    def counts(self) -> dict[str, Any]:
        """``{"put": n, "held": n, "trained": n, "discarded": {reason: n}, "corrupt": n}``."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release connections."""


# -- weight stores ----------------------------------------------------------


class WeightStore(ABC):
    """Published policy weight versions that any replica can read at any time.

    One publisher at a time (the policy leader) calls :meth:`publish`; readers
    never see a partial version: a version becomes visible only once all of
    its bytes are stored and checksummed, and a read checks the checksum. Old
    versions are garbage-collected, keeping the newest ``keep``. Reads of a
    collected (or never published) version raise
    :class:`~phalanx.comm.base.CommError`, as a corrupt one does.
    """

    @abstractmethod
    def publish(
        self, version: int, weights: Mapping[str, torch.Tensor], meta: Mapping[str, Any] = {}
    ) -> int:
        """Store ``weights`` as ``version`` and make it the latest; returns its size in
        bytes. ``meta`` (JSON) is stored with it (the sync order's ``seq``)."""

    @abstractmethod
    def latest(self) -> tuple[int, dict[str, Any]] | None:
        """(version, meta) of the newest published version, or None."""

    @abstractmethod
    def fetch(self, version: int | None = None) -> tuple[int, dict[str, torch.Tensor]]:
        """The weights of ``version`` (None: the latest), checksum verified."""

    def wait_newer(
        self, version: int, timeout_s: float, poll_s: float = 0.05
    ) -> tuple[int, dict[str, Any]] | None:
        """Block until a version newer than ``version`` is published (or ``timeout_s``
        passes: None). Returns its (version, meta); the weights are one :meth:`fetch`
        away."""
        deadline = time.monotonic() + timeout_s
        while True:
            cur = self.latest()
            if cur is not None and cur[0] > version:
                return cur
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._wait(min(poll_s, left))

    def _wait(self, seconds: float) -> None:
        time.sleep(seconds)

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release connections."""


# -- replay -----------------------------------------------------------------


class ReplayBuffer(ABC):
    """The last ``capacity`` rollouts, sampled uniformly (with replacement), for
    off-policy algorithms. Deduplicated by rollout id: adding an id already held
    does nothing. Any number of processes may add and sample concurrently
    (Redis); the in-memory buffer serves one process."""

    capacity: int

    @abstractmethod
    def add(self, rollouts: Sequence[Mapping[str, Any]]) -> int:
        """Add rollouts (newest last), evicting the oldest beyond ``capacity``.
        Returns how many were new."""

    @abstractmethod
    def sample(self, k: int, rng: random.Random | None = None) -> list[dict[str, Any]]:
        """``k`` rollouts drawn uniformly with replacement from those held ([] if none)."""

    @abstractmethod
    def __len__(self) -> int: ...

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Release connections."""

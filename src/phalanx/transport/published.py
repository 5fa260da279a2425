"""Weight sync through a :class:`WeightStore` (storage or Redis), under the
controller's sync orders.

The controller orders syncs exactly as for the collective; only the path of
the bytes changes. The policy leader serves an order by publishing its
committed weights to the store, tagged with the order's ``seq``, from its own
thread (training goes on meanwhile), and reports when the version is
committed. A rollout replica serves the same order by waiting for a version
tagged with that ``seq`` or a later one, then fetching it: the leader and the
rollout replicas never meet, so a dead member stalls nobody, and a replica
that joins late simply reads the latest version.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future
from functools import partial

import torch

from phalanx.comm.base import CommError
from phalanx.transport.base import (
    Report,
    Sends,
    SyncOrder,
    SyncResult,
    TransportError,
    WeightChannel,
    WeightStore,
)
from phalanx.transport.collective import Packed


def check_like(
    got: Mapping[str, torch.Tensor], like: Mapping[str, torch.Tensor], where: str
) -> dict[str, torch.Tensor]:
    """``got`` on the device and dtype of ``like``, or CommError if the layouts differ."""
    want = {k: (tuple(t.shape), t.dtype) for k, t in like.items()}
    have = {k: (tuple(t.shape), t.dtype) for k, t in got.items()}
    if want != have:
        diff = sorted(set(want.items()) ^ set(have.items()), key=str)[:4]
        raise CommError(
            f"weights from {where} must match this replica's model: they differ in {diff}. "
            f"Start every replica with the same [rl.model] config."
        )
    # A meta ``like`` (an engine that keeps its weights elsewhere) only gives the layout.
    return {k: got[k] if like[k].is_meta else got[k].to(like[k].device) for k in like}


class StoreWeightChannel(WeightChannel):
    def __init__(self, store: WeightStore, timeout_s: float):
        self.store, self.timeout_s = store, timeout_s
        self._sends = Sends("phalanx-publish")
        self.pending: Future[SyncResult] | None = None
        """The leader's last publish (tests and benchmarks wait on it)."""

    def publish(
        self, version: int, weights: Mapping[str, torch.Tensor], order: SyncOrder, report: Report
    ) -> None:
        if order.rank != 0:
            raise ValueError(f"publish must be called by the mesh's rank 0: got rank {order.rank}.")
        # A Packed snapshot is already a host copy of its own.
        snap = (
            dict(weights)
            if isinstance(weights, Packed)
            else {k: t.detach().to("cpu", copy=True) for k, t in weights.items()}
        )
        send = partial(self._publish, version, snap, order, report)
        self.pending = self._sends.submit(order, version, send, report)

    def _publish(
        self, version: int, snap: dict[str, torch.Tensor], order: SyncOrder, report: Report
    ) -> SyncResult:
        t0 = time.perf_counter()
        members = len(order.members)
        try:
            nbytes = self.store.publish(version, snap, {"seq": order.seq})
            res = SyncResult(order.seq, version, True, time.perf_counter() - t0, nbytes, members)
        except (OSError, TransportError, CommError) as e:
            res = SyncResult(
                order.seq, version, False, time.perf_counter() - t0, 0, members, str(e)
            )
        report(res)
        return res

    def fetch(
        self, order: SyncOrder, like: Mapping[str, torch.Tensor]
    ) -> tuple[int, dict[str, torch.Tensor]]:
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                cur = self.store.latest()
                if cur is not None and int(cur[1].get("seq", -1)) >= order.seq:
                    break
                if time.monotonic() >= deadline:
                    raise CommError(
                        f"sync {order.seq}: the policy leader published no weights for it within "
                        f"{self.timeout_s} s (latest: {cur}). It is ordered again."
                    )
                self.store.wait_newer(cur[0] if cur else -1, min(0.5, self.timeout_s))
            version, got = self.store.fetch()
        except (OSError, TransportError) as e:
            raise CommError(f"sync {order.seq}: reading the weight store failed: {e}") from e
        return version, check_like(got, like, "the weight store")

    def close(self) -> None:
        self._sends.shutdown()
        self.store.close()

"""The weight-channel interface: versioned policy weights to rollout replicas.

A *version* is the policy's committed step count whose weights a replica
holds (DESIGN.md). The controller decides *when* weights move (a sync order
after every ``sync_every`` commits, and for joiners); a channel decides
*how*: a collective broadcast over a policy-to-rollout process group
(``collective.py``), or published to storage (the transports issue).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class SyncOrder:
    """A weight-sync order from the controller, as one member sees it."""

    seq: int
    mesh_id: int
    """Changes whenever the set of members (or the leader) changes: rebuild the group."""
    members: tuple[str, ...]
    """Replica ids: the policy leader first, then the rollout replicas."""
    rank: int
    """This member's position in ``members`` (0: the leader, the source)."""
    store: str
    """Rendezvous address (``host:port``) of the leader's store."""

    @staticmethod
    def from_reply(d: dict[str, Any]) -> SyncOrder:
        return SyncOrder(d["seq"], d["mesh_id"], tuple(d["members"]), d["rank"], d["store"])


@dataclass
class SyncResult:
    seq: int
    version: int
    ok: bool
    seconds: float
    nbytes: int
    members: int
    error: str = ""


Report = Callable[[SyncResult], None]
"""Called once per order with its outcome (from the channel's own thread on the
sending side). It reports to the controller (``ControllerClient.sync_done``)."""


class WeightChannel(ABC):
    """Moves policy weights to rollout replicas.

    The policy leader calls :meth:`publish` at a step boundary, with the
    committed weights; it returns at once (the weights are snapshotted and
    sent in the background) and the outcome goes to ``report``. A rollout
    replica calls :meth:`fetch` between generation batches; it blocks until
    the weights arrived (or raises :class:`~phalanx.comm.base.CommError`),
    and never leaves the target half-written on error.
    """

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

    @abstractmethod
    def close(self) -> None:
        """Release the channel's groups and threads."""

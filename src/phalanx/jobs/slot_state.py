"""A decoupled DiLoCo slot's state in storage, and its catch-up through the rounds
the others decided: what the training slot (:mod:`phalanx.jobs.diloco_slot`) and
the RL policy slot (:mod:`phalanx.jobs.rl_diloco`) share.

``<diloco.url>/replicas/<slot>.st`` holds a slot's state after its latest
round (a packed state tree, :mod:`phalanx.train.snapshot`, put atomically). A
slot that restarts loads its own, adopts a more advanced peer's outer state
when the rounds in between are no longer in storage, then fast-forwards
through the decided rounds it missed (:meth:`DiLoCo.fast_forward`): it
computes the same θ_global bits as everyone else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import fsspec
import torch

from phalanx.checkpoint.store import put_atomic
from phalanx.config.train import DiLoCoSection
from phalanx.train.diloco import DiLoCo
from phalanx.train.snapshot import pack_state, unpack_state
from phalanx.transport.diloco_rounds import ObjectStoreAllReduce

log = logging.getLogger("phalanx.diloco")


def slot_exchange(
    dc: DiLoCoSection, name: str, members: Callable[[int], list[str] | None] | None
) -> ObjectStoreAllReduce:
    """Slot ``name``'s end of the job's object-store rounds (``<diloco.url>/rounds``)."""
    return ObjectStoreAllReduce(
        f"{dc.url.rstrip('/')}/rounds",
        name,
        compression=dc.compression,
        min_replicas=dc.min_replicas,
        grace_s=dc.grace_s,
        timeout_s=dc.round_timeout_s,
        members=members,
        aggregator=dc.aggregator or None,
        keep_rounds=dc.keep_rounds,
        storage_options=dc.storage_options,
        slots=dc.slot_names,
    )


class SlotState:
    """Slot ``name``'s state file and catch-up. Who calls: the slot's one process;
    ``steps`` is the job's last inner step (no catch-up past it)."""

    def __init__(
        self,
        dc: DiLoCoSection,
        name: str,
        diloco: DiLoCo,
        exchange: ObjectStoreAllReduce,
        steps: int,
    ):
        self.dc, self.name, self.diloco, self.exchange, self.steps = (
            dc,
            name,
            diloco,
            exchange,
            steps,
        )
        self.fs, root = fsspec.core.url_to_fs(dc.url, **dc.storage_options)
        self.root = root.rstrip("/")
        self.caught_up = 0
        """Inner steps skipped by catching up from storage (restart or left out)."""
        self.adopted_from: str | None = None

    def path(self, name: str) -> str:
        return f"{self.root}/replicas/{name}.st"

    def save(self, state: dict[str, Any]) -> None:
        self.fs.makedirs(f"{self.root}/replicas", exist_ok=True)
        put_atomic(self.fs, self.path(self.name), pack_state(state))

    def read(self, name: str) -> dict[str, Any] | None:
        try:
            return unpack_state(self.fs.cat_file(self.path(name)), self.path(name))
        except FileNotFoundError:
            return None
        except ValueError as e:
            log.warning("%s: not used (%s)", self.path(name), e)
            return None

    def restore(self, load_own: Callable[[dict[str, Any]], None]) -> None:
        """Own state (``load_own`` loads it; it must load the ``diloco`` entry too),
        then a peer's outer state if it is ahead, then catch up."""
        own = self.read(self.name)
        if own is not None:
            load_own(own)
        own_steps = self.diloco.inner_steps
        best, best_name = None, None
        for i in range(self.dc.replicas):
            peer = self.read(f"r{i}") if f"r{i}" != self.name else None
            if peer is not None and peer["diloco"]["inner_steps"] > (
                best["diloco"]["inner_steps"] if best else self.diloco.inner_steps
            ):
                best, best_name = peer, f"r{i}"
        if best is not None and not self.can_replay():
            log.info(
                "adopting %s's outer state at inner step %d (own: %d): the rounds in "
                "between are no longer in storage",
                best_name,
                best["diloco"]["inner_steps"],
                self.diloco.inner_steps,
            )
            self.diloco.load_state_dict(best["diloco"])
            self.adopted_from = best_name
        self.catch_up()
        self.caught_up = self.diloco.inner_steps - own_steps

    def can_replay(self) -> bool:
        """Whether the next exchange after this slot's position is still in storage."""
        d = self.diloco
        t = next((u for u in range(d.inner_steps + 1, self.steps + 1) if d.due(u)), None)
        if t is None:
            return True
        (j,) = d.due(t)
        return self.exchange.result(d.pseudo_gradient(j), round=d.rounds, fragment=j) is not None

    def catch_up(self) -> int:
        """Apply the decided rounds past this slot's position; the inner steps skipped."""

        def result(like: list[torch.Tensor], rnd: int, j: int) -> list[torch.Tensor] | None:
            return self.exchange.result(like, round=rnd, fragment=j)

        n = self.diloco.fast_forward(result, self.steps)
        if n:
            self.caught_up += n
            log.info("caught up %d inner steps to %d from storage", n, self.diloco.inner_steps)
        return n

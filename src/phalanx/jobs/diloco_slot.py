"""A slot of a decoupled DiLoCo job: no network path to the other replicas (a
serverless executor); pseudo-gradients go through object storage
(:class:`~phalanx.transport.diloco_rounds.ObjectStoreAllReduce`), once per round.

Layout under ``diloco.url``::

    rounds/round_<r>/f<j>/<replica>.st   the exchange (see transport/diloco_rounds.py)
    replicas/<replica>.st                each replica's state after its latest round

Replicas are named slots ``r0 .. r<n-1>`` (``n = diloco.replicas``). Data:
inner step ``s`` of the job is a global batch of ``train.global_batch_size``
samples of the exactly-once stream, split over the n slots with the FT-DDP
remainder rule; slot i trains on its share of its *own* data steps, which
advance only with rounds its pseudo-gradient was averaged into. A slot left
out of a round (it missed the deadline) rewinds its data to the round's
start, so no sample is both trained and dropped; no sample is ever trained
twice.

A slot that restarts (killed, preempted) loads its own state, adopts a more
advanced peer's outer state if its own is behind what storage still holds,
and fast-forwards through the rounds it missed by reading their decided
results: it computes the same θ_global bits as everyone else, then trains on.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from phalanx.config import JobConfig
from phalanx.data.sampler import ElasticSampler
from phalanx.jobs import task
from phalanx.jobs.base import JobError, ReplicaArgs
from phalanx.jobs.common import emit, keep_freed_memory
from phalanx.jobs.device import resolve_device
from phalanx.jobs.mlp import build_optimizer
from phalanx.jobs.slot_state import SlotState, slot_exchange
from phalanx.train.batch import micro_batches, split
from phalanx.train.diloco import DiLoCo

log = logging.getLogger("phalanx.diloco")

SLOT = re.compile(r"^r(\d+)$")


def slot_index(name: str, replicas: int) -> int:
    m = SLOT.match(name)
    if m is None or int(m.group(1)) >= replicas:
        raise JobError(
            f"a decoupled DiLoCo replica must be named r0 .. r{replicas - 1} (diloco.replicas = "
            f"{replicas}; each slot owns a share of the data): got {name!r}."
        )
    return int(m.group(1))


class DecoupledReplica:
    """One slot of a decoupled DiLoCo job. Who calls: one process per slot, at
    most one at a time per name (the launcher restarts a failed slot)."""

    def __init__(
        self,
        cfg: JobConfig,
        name: str,
        members: Callable[[int], list[str] | None] | None = None,
    ):
        dc, tc = cfg.diloco, cfg.train
        if dc is None or dc.mode != "objectstore":
            raise JobError(
                'a decoupled DiLoCo slot needs diloco.mode = "objectstore": got '
                f"{dc.mode if dc else 'no [diloco] section'}."
            )
        self.cfg, self.dc, self.tc, self.name = cfg, dc, tc, name
        self.index = slot_index(name, dc.replicas)
        job = task.build(tc, cfg.job.seed, resolve_device(tc.device))
        self.model, self.compute = job.model, job.compute
        self.optimizer = build_optimizer(tc, self.model)
        self.sampler = ElasticSampler(job.dataset_size, seed=cfg.job.seed)
        self.exchange = slot_exchange(dc, name, members)
        self.diloco = DiLoCo(self.model, dc.outer(), self.exchange)
        self.slot = SlotState(dc, name, self.diloco, self.exchange, tc.steps)
        self.data_step = 0
        """This slot's own data steps (inner steps whose samples were used)."""
        self.round_start_data_step = 0
        self.rewound = 0

    @property
    def caught_up(self) -> int:
        """Inner steps skipped by catching up from storage (restart or left out)."""
        return self.slot.caught_up

    @property
    def adopted_from(self) -> str | None:
        return self.slot.adopted_from

    # -- state in storage --------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "diloco": self.diloco.state_dict(),
            "data_step": self.data_step,
        }

    def save(self) -> None:
        self.slot.save(self.state_dict())

    def _load(self, own: dict[str, Any]) -> None:
        self.model.load_state_dict(own["model"])
        self.optimizer.load_state_dict(own["optimizer"])
        self.diloco.load_state_dict(own["diloco"])
        self.data_step = int(own["data_step"])

    def restore(self) -> None:
        """Own state, then a peer's outer state if it is ahead, then catch up."""
        self.slot.restore(self._load)

    def catch_up(self) -> int:
        return self.slot.catch_up()

    # -- training ----------------------------------------------------------

    def share(self) -> list[int]:
        batch, n = self.tc.global_batch_size, self.dc.replicas
        off, count = split(batch, n, self.index)
        return self.sampler.positions(self.data_step * batch + off, count)

    def inner_step(self) -> float:
        idx = self.share()
        self.optimizer.zero_grad(set_to_none=False)
        loss = 0.0
        for mb in micro_batches(idx, self.tc.micro_batch_size or max(1, len(idx))):
            loss += float(self.compute(mb, 1.0 / max(1, len(idx))))
        if idx:
            self.optimizer.step()
        self.data_step += 1
        return loss / max(1, len(idx))

    def run(self, out: Path | None = None) -> int:
        self.restore()
        emit(
            {
                "event": "start",
                "replica": self.name,
                "inner_step": self.diloco.inner_steps,
                "round": self.diloco.rounds,
                "caught_up": self.caught_up,
                "adopted_from": self.adopted_from,
            }
        )
        losses: list[float] = []
        t0 = time.perf_counter()
        while self.diloco.inner_steps < self.tc.steps:
            losses.append(self.inner_step())
            done = self.diloco.after_inner_step()
            if self.diloco.inner_steps == self.tc.steps:
                self.diloco.finish()
            if not done:
                continue
            members = self.exchange.last_members
            included = self.name in members
            if not included and self.dc.fragments == 1:
                # Left out: this round's samples were trained but not used; train them again.
                self.data_step = self.round_start_data_step
                self.rewound += 1
            self.round_start_data_step = self.data_step
            self.save()
            emit(
                {
                    "event": "round",
                    "replica": self.name,
                    "round": self.diloco.rounds,
                    "inner_step": self.diloco.inner_steps,
                    "fragment": done[0],
                    "members": members,
                    "included": included,
                    "loss": sum(losses) / len(losses),
                    "data_step": self.data_step,
                    "bytes_sent": self.exchange.bytes_sent,
                    "bytes_read": self.exchange.bytes_read,
                    "corrupt": self.exchange.corrupt,
                    "round_s": round(time.perf_counter() - t0, 4),
                    "t": time.time(),
                }
            )
            losses, t0 = [], time.perf_counter()
            # Fell behind (left out): what the others decided since is in storage.
            if not included:
                self.catch_up()
        if out is not None:
            save_params(out, self.model, self.diloco)
        emit(
            {
                "event": "done",
                "replica": self.name,
                "inner_step": self.diloco.inner_steps,
                "round": self.diloco.rounds,
                "rewound": self.rewound,
                "caught_up": self.caught_up,
                "left_out": self.exchange.left_out,
                "corrupt": self.exchange.corrupt,
                "bytes_sent": self.exchange.bytes_sent,
                "bytes_read": self.exchange.bytes_read,
            }
        )
        return 0


def save_params(path: Path, model: torch.nn.Module, diloco: DiLoCo) -> None:
    """The final parameters and θ_global (safetensors), for comparing replicas."""
    from phalanx.tensorfile import save_file

    out = {f"model.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for n, g in zip(diloco.names, diloco.global_params, strict=True):
        out[f"global.{n}"] = g.detach().clone()
    save_file(out, path, metadata={"inner_step": str(diloco.inner_steps)})


def run(args: ReplicaArgs) -> int:
    """One slot of a decoupled DiLoCo job, until the job's inner steps are done.
    With a controller, each round's members are its quorum of the live slots."""
    cfg, name, controller, out = args.cfg, args.name, args.controller, args.out
    keep_freed_memory()
    torch.set_num_threads(cfg.train.threads)
    client = None
    members = None
    if controller:
        from phalanx.client import ControllerClient

        client = ControllerClient(controller, "policy", name)
        client.register()
        client.start_heartbeat()
        timeout = cfg.diloco.round_timeout_s if cfg.diloco else None

        def members(rnd: int) -> list[str] | None:
            try:
                return [m.name for m in client.quorum(rnd, timeout).members]
            except Exception as e:  # the controller is gone: decide by deadline
                log.warning("no quorum from the controller for round %d (%s)", rnd, e)
                return None

    try:
        return DecoupledReplica(cfg, name, members).run(out)
    finally:
        if client is not None:
            client.close("finished")

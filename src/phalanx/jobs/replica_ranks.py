"""What every loop of a replica that may span several ranks does alike: find its
ranks, register through rank 0, and stop as a whole when a rank is gone
(:mod:`phalanx.train.hsdp`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from phalanx.client import ControllerClient
from phalanx.comm.torch_pg import serve_store
from phalanx.config import JobConfig
from phalanx.jobs.base import JobError
from phalanx.jobs.common import register
from phalanx.train.hsdp import RankClient, ReplicaRanks, env_ranks
from phalanx.train.shards import shard_model
from phalanx.train.tp_hf import TPError, parallelize

log = logging.getLogger("phalanx.jobs")


class OneRank:
    """A replica of one process: it is its own leader, and shares with nobody
    (the interface of :class:`~phalanx.train.hsdp.ReplicaRanks` that a loop uses)."""

    rank, size, leader = 0, 1, True

    def broadcast_json(self, value: Any = None) -> Any:
        return value

    def sum(self, values: list[float]) -> list[float]:
        return values

    def close(self) -> None:
        """Nothing to tear down: there is no replica group."""


def replica_ranks(cfg: JobConfig, device: torch.device | None = None) -> OneRank | ReplicaRanks:
    """This process's replica: one rank, or the N ranks of ``[replica] ranks``
    (torchrun's environment, as :mod:`phalanx.launch.ranks` sets it)."""
    _, world = env_ranks()
    if world != cfg.replica.ranks:
        raise JobError(
            f"this replica was started with {world} ranks (WORLD_SIZE) but the job's "
            f"[replica] ranks is {cfg.replica.ranks}: start it through `phalanx run`, or "
            f"`python -m phalanx.launch.ranks --nproc {cfg.replica.ranks} -- ...`"
        )
    if world == 1:
        return OneRank()
    here = int(os.environ.get("LOCAL_WORLD_SIZE", world))  # fewer when it spans hosts
    if torch.cuda.is_available() and torch.cuda.device_count() % here:
        raise JobError(
            f"the replica's ranks on this host must divide its {torch.cuda.device_count()} "
            f"GPUs: got {here}"
        )
    t = cfg.timeouts
    return ReplicaRanks(
        t.quorum_s + t.heartbeat_s + 4 * t.collective_s + 10.0, device, tp=cfg.replica.tp
    )


def wrap(model: torch.nn.Module, ranks: ReplicaRanks) -> torch.nn.Module:
    """The replica's model sharded over its ranks: FSDP2, or the model's own TP plan
    then FSDP2 over the rest (``[replica] tp``). JobError in one line for a model that
    cannot be tensor-parallel at this degree."""
    if ranks.tp_mesh is None:
        return shard_model(model, ranks.mesh)
    try:
        return parallelize(model, ranks.tp_mesh, ranks.mesh)
    except TPError as e:
        raise JobError(str(e)) from None


def register_ranks(
    controller: str,
    role: str,
    name: str,
    ranks: OneRank | ReplicaRanks,
    facts: Callable[[ControllerClient], dict[str, Any]],
    root: Callable[[ControllerClient], None] | None = None,
) -> tuple[Any, Any, dict[str, Any]]:
    """Rank 0 registers the replica (with its number of ranks) and tells every rank
    the replica's id and ``facts(client)`` (what each rank must know before it
    starts: e.g. whether the job is already finished). ``root(client)`` gives the
    client its checkpoint root first (:func:`~phalanx.jobs.common.use_root`).
    Returns (client, store, facts): the client is a :class:`RankClient` on the other
    ranks, which never talk to the controller, and the store only rank 0's. A
    refused registration (or a root that cannot be used) raises JobError on every
    rank."""
    if not ranks.leader:
        msg = ranks.broadcast_json()
        if "refused" in msg:
            raise JobError(msg["refused"])
        follower = RankClient(role, name, ranks.rank)
        follower.replica_id = msg["replica_id"]
        follower.who.replica_id = msg["replica_id"]
        return follower, None, msg["facts"]
    store, address = serve_store()
    tp = getattr(ranks, "tp", 1)  # (the layout: the controller refuses another one's)
    client = ControllerClient(controller, role, name, address=address, ranks=ranks.size, tp=tp)
    try:
        if root is not None:
            root(client)
        register(client)
    except JobError as e:  # refused: every rank says so and stops
        ranks.broadcast_json({"refused": str(e)})
        raise
    known = facts(client)
    ranks.broadcast_json({"replica_id": client.replica_id, "facts": known})
    return client, store, known


def replica_stopped(rank: int, e: BaseException) -> int:
    """A rank of this replica is gone (a collective inside the replica raised,
    gloo's as a plain RuntimeError): this rank stops, and its launcher restarts
    the whole replica, which then heals from a peer replica or resumes from the
    checkpoint. One line; the traceback is kept for --log-level debug. Returns
    the exit status."""
    first = (str(e).splitlines() or [type(e).__name__])[0][:300]
    log.error("rank %d: %s; the replica stops", rank, first)
    log.debug("the failure that stopped the replica", exc_info=True)
    return 1

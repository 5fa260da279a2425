"""``phalanx syncer``: the aggregator of a decoupled DiLoCo job that takes no
part in training (``diloco.aggregator = "syncer"``). For every exchange of
the job, in order, it waits for the round's decided member list, averages
the members' pseudo-gradients and writes ``_result.st``; the slots then read
one object per round instead of k. It needs the storage and the job config
only (the model is built to know the fragments' shapes and dtypes).

A syncer that dies costs nothing but reads: a slot that waited
``round_timeout_s`` for a result averages the objects itself, with the same
bits. Restarted, it resumes at the oldest exchange still in storage that has
no result.
"""

from __future__ import annotations

import logging
import time

import torch

from phalanx.jobs.base import JobError, ReplicaArgs
from phalanx.jobs.common import emit
from phalanx.jobs.task import build_model
from phalanx.train.diloco import DiLoCo
from phalanx.transport.diloco_rounds import RESULT, ObjectStoreAllReduce

log = logging.getLogger("phalanx.diloco")

NAME = "syncer"


def run(args: ReplicaArgs) -> int:
    cfg = args.cfg
    dc = cfg.diloco
    if dc is None or dc.mode != "objectstore" or dc.aggregator != NAME:
        raise JobError(
            'phalanx syncer serves decoupled DiLoCo jobs with diloco.aggregator = "syncer": '
            f"got diloco = {dc and {'mode': dc.mode, 'aggregator': dc.aggregator}}. Set "
            'diloco.mode = "objectstore" and diloco.aggregator = "syncer".'
        )
    torch.set_num_threads(cfg.train.threads)
    exchange = ObjectStoreAllReduce(
        f"{dc.url.rstrip('/')}/rounds",
        NAME,
        compression=dc.compression,
        timeout_s=dc.round_timeout_s,
        aggregator=NAME,
        storage_options=dc.storage_options,
        slots=dc.slot_names,
    )
    diloco = DiLoCo(build_model(cfg.train, cfg.job.seed), dc.outer(), exchange)
    todo = diloco.exchanges(cfg.train.steps)
    oldest = _oldest_round(exchange)
    emit({"event": "start", "replica": NAME, "exchanges": len(todo), "from_round": oldest})
    served = skipped = 0
    for rnd, j in todo:
        key = exchange.key(rnd, j)
        if rnd < oldest or exchange.fs.exists(f"{key}/{RESULT}"):
            skipped += 1
            continue
        t0 = time.perf_counter()
        n = exchange.aggregate(diloco.pseudo_gradient(j), round=rnd, fragment=j)
        served += 1
        emit(
            {
                "event": "aggregated",
                "replica": NAME,
                "round": rnd,
                "fragment": j,
                "n": n,
                "seconds": round(time.perf_counter() - t0, 4),
                "bytes_read": exchange.bytes_read,
                "corrupt": exchange.corrupt,
            }
        )
    emit({"event": "done", "replica": NAME, "served": served, "skipped": skipped})
    return 0


def _oldest_round(exchange: ObjectStoreAllReduce) -> int:
    """The oldest round still in storage (older ones were collected), or 0."""
    exchange.fs.invalidate_cache(exchange.root)
    try:
        names = exchange.fs.ls(exchange.root, detail=False)
    except FileNotFoundError:
        return 0
    rounds = [
        int(n.rstrip("/").rsplit("round_", 1)[1]) for n in names if "round_" in n.rsplit("/", 1)[-1]
    ]
    return min(rounds, default=0)

"""A replica of the FT data-parallel job (DESIGN.md, Main flows: policy step).

Each step: quorum (rebuild the group and heal a joiner if membership
changed), this replica's share of the constant global batch, all-reduce,
commit everywhere or nowhere. It prints one JSON line per committed step on
stdout (``phalanx run`` reads them for its progress view), checkpoints on
schedule or on order, and leaves when drained or when the job's steps are
committed.
"""

from __future__ import annotations

import logging
import time

from phalanx.client import QuorumTimeout
from phalanx.jobs.base import JobError, ReplicaArgs
from phalanx.jobs.common import emit_step, state_hash
from phalanx.jobs.training import (
    after_commit,
    close_replica,
    emit_finished_elsewhere,
    emit_retry,
    finish_replica,
    setup_replica,
    start_checkpoints,
    task_figures,
)
from phalanx.train.base import JobFinished

log = logging.getLogger("phalanx.train")


def run(args: ReplicaArgs) -> int:
    """Train the job's model (yours, or the built-in task) as one replica until the
    job's last step."""
    cfg, tc = args.cfg, args.cfg.train
    s = setup_replica(cfg, str(args.controller), args.name, tc.global_batch_size)
    if s is None:
        return 0
    start_checkpoints(cfg, s)
    manager, client, sampler = s.manager, s.client, s.manager.sampler
    if sampler is None:  # unreachable: setup_replica gives the manager its sampler
        raise JobError("the FT-DDP replica needs a sampler")
    last = time.perf_counter()
    try:
        while manager.step < tc.steps:
            try:
                r = manager.train_step(s.compute)
            except QuorumTimeout as e:
                log.warning("%s; asking again", e)
                continue
            except JobFinished as e:
                log.info("%s; nothing left to do", e)
                emit_finished_elsewhere(s)
                return 0
            if r.committed:
                now = time.perf_counter()
                client.report_progress(loss=r.loss)
                samples = manager.last_indices if tc.log_samples else None
                digest = {"state_hash": state_hash(manager.model)} if tc.log_state_hash else {}
                # A joiner's first line says how its heal went (Manager.last_heal), as
                # a replica of several ranks does.
                heal = {"heal": manager.last_heal} if r.healed else {}
                extra = {**digest, **heal, **task_figures(s, now - last)}
                last = now
                emit_step(
                    client.replica_id, r, sampler.cursor, samples, sampler.num_samples, **extra
                )
                if after_commit(cfg, s, r.step):
                    return 0
            else:
                emit_retry(s, r.step, r.error)
        finish_replica(cfg, s, args.out)
    finally:
        close_replica(s)
    return 0

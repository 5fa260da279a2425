"""The built-in training job with DiLoCo's outer loop (``[diloco]`` in the job
config): the same model, data and controller as the FT-DDP job, with the
replicas exchanging pseudo-gradients once per ``sync_every`` inner steps.

``mode = "sync"`` runs :class:`~phalanx.train.diloco_sync.SyncDiLoCo` (a
quorum per round over the FT manager's process group); ``mode =
"objectstore"`` runs the decoupled slot of :mod:`phalanx.jobs.diloco_slot`.
Each replica prints one JSON line per committed round on stdout.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from phalanx.client import QuorumTimeout
from phalanx.jobs.base import JobError, ReplicaArgs
from phalanx.jobs.common import emit
from phalanx.jobs.training import (
    after_commit,
    close_replica,
    emit_finished_elsewhere,
    emit_retry,
    finish_replica,
    setup_replica,
    start_checkpoints,
)
from phalanx.train.base import JobFinished
from phalanx.train.diloco_sync import SyncDiLoCo

log = logging.getLogger("phalanx.diloco")


def run(args: ReplicaArgs) -> int:
    """One replica of a synchronous DiLoCo job, until the job's rounds are committed."""
    cfg = args.cfg
    dc, tc = cfg.diloco, cfg.train
    if dc is None:
        raise JobError("a DiLoCo replica needs a [diloco] section in the job config: got none.")
    rounds = tc.steps // dc.sync_every
    s = setup_replica(cfg, str(args.controller), args.name, dc.sync_every * tc.global_batch_size)
    if s is None:
        return 0
    loop = SyncDiLoCo(s.manager, dc.outer(), tc.global_batch_size, exact=tc.exact_reduction)
    start_checkpoints(cfg, s)
    m, client = s.manager, s.client
    try:
        while m.step < rounds:
            try:
                r = loop.train_round(s.compute, last=m.step + 1 == rounds)
            except QuorumTimeout as e:
                log.warning("%s; asking again", e)
                continue
            except JobFinished as e:
                log.info("%s; nothing left to do", e)
                emit_finished_elsewhere(s)
                return 0
            if not r.committed:
                emit_retry(s, r.round, r.error)
                continue
            client.report_progress(loss=r.loss)
            extra: dict[str, Any] = {"samples": r.samples} if tc.log_samples else {}
            if tc.log_samples and m.sampler is not None:
                extra["dataset_size"] = m.sampler.num_samples  # (phalanx.audit.data)
            emit(
                {
                    **extra,
                    "event": "step",
                    "replica": client.replica_id,
                    "step": r.round,
                    "inner_step": loop.diloco.inner_steps,
                    "loss": r.loss,
                    "participants": r.participants,
                    "quorum_id": r.quorum_id,
                    "healed": r.healed,
                    "cursor": m.sampler.cursor if m.sampler is not None else 0,
                    "bytes_sent": loop.reducer.bytes_sent,
                    # Blocked on exchanges so far (Streaming DiLoCo's τ hides the rest).
                    "exchange_wait_s": round(loop.reducer.wait_s, 4),
                    "round_s": round(r.seconds, 4),
                    "t": time.time(),
                }
            )
            if after_commit(cfg, s, r.round):
                return 0
        # The final file is the job's output: θ_global, the same on every replica. The
        # inner optimizer's state is each replica's own (it saw its own data).
        finish_replica(cfg, s, args.out, optimizer=False)
    finally:
        close_replica(s)
    return 0

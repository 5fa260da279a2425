"""One rank of a replica of the FT data-parallel job that spans several ranks
(``[replica] ranks = N``; :mod:`phalanx.train.hsdp`).

``phalanx run`` starts each replica's N ranks through
:mod:`phalanx.launch.ranks`, which sets torchrun's environment; ``phalanx
replica`` runs this loop instead of :mod:`phalanx.jobs.ft_ddp` whenever
``WORLD_SIZE`` is above 1. The model is sharded over the replica's ranks with
FSDP2; rank 0 talks to the controller and prints the JSON lines (the ``step``
line carries the whole replica's share of the batch); every rank trains its
part of the replica's share.

At each committed step rank 0 also tells the other ranks whether the
replica leaves now (a drain ordered by the operator) and whether a
checkpoint is due, so that every rank acts at the same step. Checkpoints
(``checkpoint.url``) hold every rank's shards and load into a replica of any
size (:meth:`~phalanx.train.hsdp.HSDPManager.load_checkpoint`). The final
state (``--out``) is gathered whole, so it compares with a run of replicas
of any other size.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from phalanx.client import QuorumTimeout
from phalanx.comm.torch_pg import TorchCommunicator
from phalanx.config import JobConfig
from phalanx.data.sampler import ElasticSampler
from phalanx.jobs import task
from phalanx.jobs.base import JobError, ReplicaArgs
from phalanx.jobs.common import (
    emit,
    emit_step,
    keep_freed_memory,
    make_checkpointer,
    resume,
    save_checkpoint,
    use_root,
)
from phalanx.jobs.device import data_plane, nccl_env, resolve_device
from phalanx.jobs.mlp import build_optimizer
from phalanx.jobs.replica_ranks import register_ranks, replica_ranks, replica_stopped, wrap
from phalanx.jobs.training import exact_options
from phalanx.train.base import JobFinished
from phalanx.train.hsdp import (
    HSDPManager,
    LayoutMismatch,
    ReplicaBroken,
    ReplicaRanks,
    local,
)
from phalanx.train.orders import Orders

if TYPE_CHECKING:
    from phalanx.checkpoint import Checkpointer

log = logging.getLogger("phalanx.train")


def gathered_state(manager: HSDPManager) -> dict[str, torch.Tensor]:
    """The whole model and optimizer state under :func:`~phalanx.jobs.common.flat_state`'s
    names (a collective over the replica's ranks)."""

    def full(t: torch.Tensor) -> torch.Tensor:
        g = t.full_tensor() if hasattr(t, "full_tensor") else t
        return g.detach().clone().cpu()

    out = {f"model.{k}": full(v) for k, v in manager.model.state_dict().items()}
    for pid, st in manager.optimizer.state_dict()["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                out[f"optim.{pid}.{k}"] = full(v)
    return out


def run(args: ReplicaArgs) -> int:
    cfg, tc = args.cfg, args.cfg.train
    keep_freed_memory()
    torch.set_num_threads(tc.threads)
    t = cfg.timeouts
    device = resolve_device(tc.device)
    backend = data_plane(device, tc.data_plane)
    ranks = replica_ranks(cfg, device)
    if not isinstance(ranks, ReplicaRanks):
        raise JobError("ft_hsdp runs replicas of several ranks: [replica] ranks must be > 1")
    client, store, facts = register_ranks(
        str(args.controller),
        "policy",
        args.name,
        ranks,
        lambda c: {"job_step": c.status().role_step("policy")},
        lambda c: use_root(
            c,
            cfg.checkpoint.url,
            what="checkpoint.url",
            storage_options=cfg.checkpoint.storage_options,
            resume=cfg.checkpoint.resume,
        ),
    )
    job_step = int(facts["job_step"])
    total = cfg.job_steps
    if job_step >= total:
        if ranks.leader:
            emit({"event": "done", "replica": client.replica_id, "step": job_step, "heals": 0})
            client.close("job already finished")
        ranks.close()
        return 0
    if ranks.leader:
        client.start_heartbeat()
    if backend == "nccl":
        nccl_env(t.quorum_s)
    job = task.build(tc, cfg.job.seed, device, always_forward=True, wrap=lambda m: wrap(m, ranks))
    model = job.model
    manager = HSDPManager(
        client,
        ranks,
        TorchCommunicator(t.collective_s, device, backend=backend),
        model,
        build_optimizer(tc, model),
        ElasticSampler(job.dataset_size, seed=cfg.job.seed),
        global_batch_size=tc.global_batch_size,
        bucket_bytes=int(tc.bucket_mb * (1 << 20)),
        quorum_timeout_s=t.quorum_s,
        trainable_only=tc.lora is not None,  # LoRA: heal and save the adapter
        **exact_options(cfg),
    )
    manager.total_steps = total
    compute = job.compute
    # Every rank makes the checkpointer (its group is a collective) and loads its
    # shards of the latest checkpoint, saved by replicas of any size.
    ckpt = make_checkpointer(cfg, client)
    resumed = resume(ckpt, manager) if ckpt is not None and cfg.checkpoint.resume else None
    run = _Run(cfg, args, manager, compute, Orders(client) if ranks.leader else None, ckpt)
    run.saved = resumed
    if ranks.leader:
        params = sum(local(p).numel() for p in model.parameters())
        emit(
            {
                "event": "start",
                "replica": client.replica_id,
                "params": params,
                "ranks": ranks.size,
                "tp": ranks.tp,
                "resumed_from": resumed,
            }
        )
    why = "finished"
    try:
        return run.loop()
    except LayoutMismatch as e:
        raise JobError(str(e)) from e
    except (ReplicaBroken, dist.DistError, RuntimeError) as e:
        why = "stopped: a rank of this replica failed"
        return replica_stopped(ranks.rank, e)
    finally:
        if ckpt is not None:
            ckpt.close()
        manager.close()
        if ranks.leader:
            client.close(why)
        ranks.close()
        del store


class _Run:
    """The step loop of one rank, with the checkpoints its replica saves when it is
    the quorum's rank 0 (every rank of it saves its shards)."""

    def __init__(
        self,
        cfg: JobConfig,
        args: ReplicaArgs,
        manager: HSDPManager,
        compute: Any,
        orders: Orders | None,
        ckpt: Checkpointer | None,
    ):
        self.cfg, self.args, self.manager, self.compute = cfg, args, manager, compute
        self.orders, self.ckpt = orders, ckpt
        self.saved: int | None = None
        """The last step this replica made durable (saved, or resumed from)."""

    def done(self, **extra: Any) -> None:
        if self.manager.ranks.leader:
            m = self.manager
            emit(
                {
                    "event": "done",
                    "replica": m.client.replica_id,
                    "step": m.step,
                    "heals": m.heals,
                    **extra,
                }
            )

    def save(self, *, final: bool) -> None:
        if self.ckpt is None or self.manager.rank != 0 or self.saved == self.manager.step:
            return
        if final:
            self.ckpt.wait()
        save_checkpoint(self.ckpt, self.cfg, self.manager, final=final)
        self.saved = self.manager.step

    def loop(self) -> int:
        manager, tc = self.manager, self.cfg.train
        ranks, client, sampler = manager.ranks, manager.client, manager.sampler
        assert sampler is not None
        while manager.step < tc.steps:
            try:
                r = manager.train_step(self.compute)
            except QuorumTimeout as e:
                log.warning("%s; asking again", e)
                continue
            except JobFinished as e:
                log.info("%s; nothing left to do", e)
                self.done(finished_elsewhere=True)
                return 0
            if not r.committed:
                if ranks.leader:
                    emit(
                        {
                            "event": "retry",
                            "replica": client.replica_id,
                            "step": r.step,
                            "error": (r.error or "")[:200],
                            "t": time.time(),
                        }
                    )
                continue
            if self.after_commit(r):
                return 0
        if self.ckpt is not None:
            self.ckpt.wait()
            self.save(final=True)
        state = gathered_state(manager) if self.args.out is not None else None
        if ranks.leader and state is not None and self.args.out is not None:
            _save(Path(self.args.out), state, manager)
        self.done()
        return 0

    def after_commit(self, r: Any) -> bool:
        """Print the step, take in operator commands (rank 0 reads them and tells
        the others), save when due; True when the replica leaves (drained). A
        drained replica that is the quorum's rank 0 saves its step first, so that
        the job's last step is durable when its last replica leaves (the way to a
        new layout: drain, then start replicas of another size)."""
        manager, cfg = self.manager, self.cfg
        ranks, client, sampler = manager.ranks, manager.client, manager.sampler
        assert sampler is not None
        every = cfg.checkpoint.every_steps
        scheduled = self.ckpt is not None and bool(every) and r.step % every == 0
        news = None
        if ranks.leader:
            assert self.orders is not None
            client.report_progress(loss=r.loss)
            samples = manager.replica_indices if cfg.train.log_samples else None
            heal = {"heal": manager.last_heal} if r.healed else {}
            emit_step(
                client.replica_id, r, sampler.cursor, samples, sampler.num_samples,
                ranks=ranks.size, **heal,
            )  # fmt: skip
            self.orders.poll(r.step)
            ordered = not scheduled and self.orders.checkpoint_due(r.step)
            news = {"drain": self.orders.drain, "save": scheduled or ordered}
        news = ranks.broadcast_json(news)
        if news["save"]:
            self.save(final=False)
        if not news["drain"]:
            return False
        self.save(final=True)
        if ranks.leader:
            log.info("drained at step %d: leaving the job", manager.step)
        self.done(drained=True)
        return True


def _save(path: Path, state: dict[str, torch.Tensor], manager: HSDPManager) -> None:
    from phalanx.tensorfile import save_file

    cursor = manager.sampler.cursor if manager.sampler is not None else 0
    save_file(state, path, metadata={"step": str(manager.step), "cursor": str(cursor)})

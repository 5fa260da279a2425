"""A training replica's life: joining the job (your model or the built-in task on
its device, the FT manager, the checkpointer), the step boundary after a commit
(operator commands, scheduled saves, drain) and its end (the last step durable, the
final state written, ``done``). FT-DDP, sync DiLoCo and :class:`phalanx.Replica`
(your own loop) share it; what every job loop shares is in :mod:`.common`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from phalanx.client import ControllerClient
from phalanx.comm.torch_pg import TorchCommunicator, serve_store
from phalanx.config import JobConfig
from phalanx.data.sampler import ElasticSampler
from phalanx.jobs import task
from phalanx.jobs.common import (
    emit,
    keep_freed_memory,
    make_checkpointer,
    register,
    resume,
    save_checkpoint,
    save_final,
    use_root,
)
from phalanx.jobs.device import data_plane, nccl_env, resolve_device
from phalanx.jobs.mlp import build_optimizer
from phalanx.train.manager import Compute, Manager
from phalanx.train.orders import Orders

if TYPE_CHECKING:
    from phalanx.checkpoint import Checkpointer

log = logging.getLogger("phalanx.train")


@dataclass
class ReplicaSetup:
    """What every replica of the training job holds once it has joined."""

    client: ControllerClient
    store: Any
    """This replica's rendezvous store (kept alive for the replica's lifetime)."""
    manager: Manager
    compute: Compute
    ckpt: Checkpointer | None
    resumed: int | None
    orders: Orders
    saved: int | None = None
    """The last step durable in a checkpoint by this replica's doing (saved, or
    resumed from): :func:`finish_replica` saves the final step unless it is this one."""
    task: task.Task | None = None
    """The task it trains (None: a loop of your own, :class:`phalanx.Replica`)."""


def exact_options(cfg: JobConfig) -> dict[str, Any]:
    """The manager's micro-batching and reduction for ``cfg``: in an FT data-parallel
    job with ``train.exact_reduction``, exact units of a fixed size (a DiLoCo job sums
    its outer round exactly instead: :class:`~phalanx.train.diloco_sync.SyncDiLoCo`)."""
    exact = cfg.train.exact_reduction and cfg.diloco is None
    size = cfg.exact_micro_batch_size if exact else cfg.train.micro_batch_size or None
    return {"micro_batch_size": size, "exact_reduction": exact}


def attach_replica(
    cfg: JobConfig,
    controller: str,
    name: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    dataset_size: int,
    global_batch_size: int,
    steps: int,
    micro_batch_size: int | None = None,
    device: torch.device | None = None,
    backend: str | None = None,
) -> ReplicaSetup | None:
    """Join the job as one replica training ``model`` with ``optimizer``: serve this
    replica's rendezvous store, register (with its checkpoint root and the step it
    can resume from), start the heartbeat, and build the FT manager over a sampler
    of ``dataset_size`` samples, on ``device`` with collectives over ``backend``
    (:mod:`phalanx.jobs.device`). None (after printing ``done``) when the job already
    committed its ``steps``. The compute is the caller's; the returned setup's
    ``compute`` is a placeholder until it sets one."""
    dev = device or torch.device("cpu")
    store, address = serve_store()
    client = ControllerClient(controller, "policy", name, address=address)
    cc = cfg.checkpoint
    use_root(
        client,
        cc.url,
        what="checkpoint.url",
        storage_options=cc.storage_options,
        resume=cc.resume,
    )
    register(client)
    job_step = client.status().role_step("policy")
    if job_step >= steps:
        emit({"event": "done", "replica": client.replica_id, "step": job_step, "heals": 0})
        log.info("the job already committed its %d steps; nothing to do", steps)
        client.close("job already finished")
        return None
    client.start_heartbeat()
    t = cfg.timeouts
    backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
    if backend == "nccl":
        nccl_env(t.quorum_s)
    # Patient collectives wait on gloo's CPU ops (pings tell a slow peer from a dead one).
    patience = t.collective_patience_s if dev.type == "cpu" else 0.0
    options = exact_options(cfg)
    if micro_batch_size is not None and not options["exact_reduction"]:
        options["micro_batch_size"] = micro_batch_size or None
    manager = Manager(
        client,
        TorchCommunicator(t.collective_s, dev, patience, backend),
        model,
        optimizer,
        ElasticSampler(dataset_size, seed=cfg.job.seed),
        global_batch_size=global_batch_size,
        bucket_bytes=int(cfg.train.bucket_mb * (1 << 20)),
        quorum_timeout_s=t.quorum_s,
        trainable_only=cfg.train.lora is not None,  # LoRA: heal and save the adapter
        **options,
    )
    manager.total_steps = steps
    manager.accumulator.slowdown = cfg.train.slowdown_for(name)
    return ReplicaSetup(
        client, store, manager, _no_compute, ckpt=None, resumed=None, orders=Orders(client)
    )


def task_figures(s: ReplicaSetup, step_s: float, ranks: int = 1) -> dict[str, float]:
    """A committed step's figures for its line: the task's ``tokens_per_s``, ``mfu`` and
    ``peak_mem_mb`` (``step_s``: commit to commit), and every ``data.val_every`` steps
    the ``val_loss``, computed by the quorum's rank 0 alone (every replica holds the
    same weights after a commit)."""
    t = s.task
    if t is None:
        return {}
    out = t.figures(step_s, s.manager.world_size, ranks)
    if t.val_every and s.manager.step % t.val_every == 0 and s.manager.rank == 0:
        v = t.val_loss()
        if v is not None:
            out["val_loss"] = round(v, 6)
    return out


def _no_compute(indices: list[int], scale: float) -> float:
    raise RuntimeError("this replica's compute was never set: pass one to train_step")


def setup_replica(
    cfg: JobConfig, controller: str, name: str, global_batch_size: int
) -> ReplicaSetup | None:
    """Build the job's task (your model and data, or a built-in task) on the replica's
    device, then join the job with it (:func:`attach_replica`): manager and
    checkpointer (resuming from the latest checkpoint). None (after printing
    ``done``) when the job already committed its steps."""
    tc = cfg.train
    keep_freed_memory()
    torch.set_num_threads(tc.threads)
    device = resolve_device(tc.device)
    backend = data_plane(device, tc.data_plane)
    t = task.build(tc, cfg.job.seed, device)
    s = attach_replica(
        cfg,
        controller,
        name,
        t.model,
        build_optimizer(tc, t.model),
        dataset_size=t.dataset_size,
        global_batch_size=global_batch_size,
        steps=cfg.job_steps,
        device=device,
        backend=backend,
    )
    if s is not None:
        s.compute, s.task = t.compute, t
    return s


def start_checkpoints(cfg: JobConfig, s: ReplicaSetup) -> None:
    """Make the checkpointer, resume from the latest checkpoint, print ``start``.
    Call after every piece of state is registered with the manager."""
    s.ckpt = make_checkpointer(cfg, s.client)
    if s.ckpt is not None and cfg.checkpoint.resume:
        s.resumed = s.saved = resume(s.ckpt, s.manager)
    emit(
        {
            "event": "start",
            "replica": s.client.replica_id,
            "params": sum(p.numel() for p in s.manager.model.parameters()),
            "resumed_from": s.resumed,
        }
    )


def finish_replica(
    cfg: JobConfig, s: ReplicaSetup, out: Path | None, optimizer: bool = True
) -> None:
    """End of the job: the last step durable in a checkpoint, the final state
    written (without the optimizer's when it is each replica's own: DiLoCo's inner
    optimizer), ``done`` printed."""
    if s.ckpt is not None:
        # The last step is always durable before ``done``: a save in flight
        # (the final step may be a multiple of every_steps) is waited for.
        s.ckpt.wait()
        if s.saved != s.manager.step:
            save_checkpoint(s.ckpt, cfg, s.manager, final=True)
    if out is not None:
        save_final(out, s.manager, optimizer)
    emit(
        {
            "event": "done",
            "replica": s.client.replica_id,
            "step": s.manager.step,
            "heals": s.manager.heals,
        }
    )


def emit_finished_elsewhere(s: ReplicaSetup) -> None:
    """``done`` for a replica that found the job finished by others (no final
    state of its own to write: it holds none of the job's last step)."""
    emit(
        {
            "event": "done",
            "replica": s.client.replica_id,
            "step": s.manager.step,
            "heals": s.manager.heals,
            "finished_elsewhere": True,
        }
    )


def emit_drained(s: ReplicaSetup) -> None:
    """``done`` for a replica drained by the operator: it leaves after a commit
    (the others go on; the next quorum re-forms without it)."""
    log.info("drained at step %d: leaving the job", s.manager.step)
    emit(
        {
            "event": "done",
            "replica": s.client.replica_id,
            "step": s.manager.step,
            "heals": s.manager.heals,
            "drained": True,
        }
    )


def emit_retry(s: ReplicaSetup, step: int, error: str | None) -> None:
    """``retry`` for a step (or round) that did not commit: it runs again with the
    next quorum."""
    emit(
        {
            "event": "retry",
            "replica": s.client.replica_id,
            "step": step,
            "error": (error or "")[:200],
            "t": time.time(),
        }
    )


def close_replica(s: ReplicaSetup) -> None:
    if s.ckpt is not None:
        s.ckpt.close()
    s.manager.close()
    s.client.close("finished")


def after_commit(cfg: JobConfig, s: ReplicaSetup, step: int) -> bool:
    """The step boundary after a committed ``step`` (an FT-DDP step or a DiLoCo
    round): take in operator commands, save a checkpoint when one is due
    (``checkpoint.every_steps``) or was ordered, and leave if drained. Call it on
    every replica of the quorum, after printing the ``step`` line. Returns True
    when the replica must leave the job (its ``done`` line already printed)."""
    s.orders.poll(step)
    ckpt, every = s.ckpt, cfg.checkpoint.every_steps
    scheduled = ckpt is not None and bool(every) and step % every == 0
    # An order for a step that a scheduled save covers stays pending, and saves
    # again at the next commit: redundant, not wrong.
    ordered = not scheduled and s.orders.checkpoint_due(step)
    if ckpt is not None and (scheduled or ordered):
        save_checkpoint(ckpt, cfg, s.manager, final=False)
        s.saved = step
    if s.orders.drain:
        emit_drained(s)
        return True
    return False

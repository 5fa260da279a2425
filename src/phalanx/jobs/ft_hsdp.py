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
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from phalanx.client import ControllerClient, QuorumTimeout
from phalanx.comm.torch_pg import TorchCommunicator, serve_store
from phalanx.config import JobConfig
from phalanx.data.sampler import ElasticSampler
from phalanx.jobs import task
from phalanx.jobs.base import JobError, ReplicaArgs
from phalanx.jobs.common import (
    emit,
    emit_step,
    keep_freed_memory,
    make_checkpointer,
    register,
    resume,
    save_checkpoint,
)
from phalanx.jobs.mlp import build_optimizer
from phalanx.train.hsdp import (
    HSDPManager,
    LayoutMismatch,
    RankClient,
    ReplicaBroken,
    ReplicaRanks,
    env_ranks,
    local,
)
from phalanx.train.manager import JobFinished
from phalanx.train.orders import Orders

if TYPE_CHECKING:
    from phalanx.checkpoint import Checkpointer

log = logging.getLogger("phalanx.train")


def shard_model(model: torch.nn.Module, ranks: ReplicaRanks) -> torch.nn.Module:
    """FSDP2 over the replica's ranks: each transformer block (or, in a model
    without blocks, each layer with parameters) is its own unit, then the root.
    Gradients are summed over the ranks, not averaged (the loss is already scaled
    by 1 / global batch), with plain sums (gloo has no pre-multiplied sum)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, torch.nn.ModuleList):
        units = list(blocks)
    else:
        units = [
            m for m in model.modules() if m is not model and any(True for _ in m.parameters(False))
        ]
    # The units' outputs are views (reshapes, splits) that nothing changes in place.
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    for m in [*units, model]:
        fully_shard(m, mesh=ranks.mesh)
        m.set_gradient_divide_factor(1.0)  # type: ignore[operator]  # (each unit's own)
        m.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    return model


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


def _start(cfg: JobConfig, controller: str, name: str, ranks: ReplicaRanks) -> tuple[Any, Any, int]:
    """Rank 0 registers and says on every rank whether the job is already finished.
    Returns (client, store, job_step)."""
    if not ranks.leader:
        msg = ranks.broadcast_json()
        if "refused" in msg:
            raise JobError(msg["refused"])
        follower = RankClient("policy", name, ranks.rank)
        follower.replica_id = msg["replica_id"]
        follower.who.replica_id = msg["replica_id"]
        return follower, None, int(msg["job_step"])
    store, address = serve_store()
    leader = ControllerClient(controller, "policy", name, address=address, ranks=ranks.size)
    try:
        register(leader)
    except JobError as e:  # refused: every rank says so and stops
        ranks.broadcast_json({"refused": str(e)})
        raise
    job_step = leader.status().role_step("policy")
    ranks.broadcast_json({"replica_id": leader.replica_id, "job_step": job_step})
    return leader, store, job_step


def run(args: ReplicaArgs) -> int:
    cfg, tc = args.cfg, args.cfg.train
    keep_freed_memory()
    torch.set_num_threads(tc.threads)
    t = cfg.timeouts
    _, world = env_ranks()
    if world != cfg.replica.ranks:
        raise JobError(
            f"this replica was started with {world} ranks (WORLD_SIZE) but the job's "
            f"[replica] ranks is {cfg.replica.ranks}: start it through `phalanx run`, or "
            f"`python -m phalanx.launch.ranks --nproc {cfg.replica.ranks} -- ...`"
        )
    if torch.cuda.is_available() and torch.cuda.device_count() % world:
        raise JobError(
            f"[replica] ranks must divide this host's {torch.cuda.device_count()} GPUs: got {world}"
        )
    ranks = ReplicaRanks(t.quorum_s + t.heartbeat_s + 4 * t.collective_s + 10.0)
    client, store, job_step = _start(cfg, str(args.controller), args.name, ranks)
    total = cfg.job_steps
    if job_step >= total:
        if ranks.leader:
            emit({"event": "done", "replica": client.replica_id, "step": job_step, "heals": 0})
            client.close("job already finished")
        ranks.close()
        return 0
    if ranks.leader:
        client.start_heartbeat()
    model = shard_model(task.build_model(tc, cfg.job.seed), ranks)
    manager = HSDPManager(
        client,
        ranks,
        TorchCommunicator(t.collective_s),
        model,
        build_optimizer(tc, model),
        ElasticSampler(tc.dataset_size, seed=cfg.job.seed),
        global_batch_size=tc.global_batch_size,
        micro_batch_size=tc.micro_batch_size or None,
        bucket_bytes=int(tc.bucket_mb * (1 << 20)),
        quorum_timeout_s=t.quorum_s,
    )
    manager.total_steps = total
    compute = task.make_compute(tc, model, cfg.job.seed, always_forward=True)
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
                "resumed_from": resumed,
            }
        )
    try:
        return run.loop()
    except LayoutMismatch as e:
        raise JobError(str(e)) from e
    except (ReplicaBroken, dist.DistError, RuntimeError) as e:
        # A rank of this replica is gone (a collective inside the replica raised,
        # gloo's as a plain RuntimeError): the replica stops as a whole, and its
        # launcher restarts it; it then heals from a peer replica. The traceback
        # is kept for --log-level debug.
        first = (str(e).splitlines() or [type(e).__name__])[0][:300]
        log.error("rank %d: %s; the replica stops", ranks.rank, first)
        log.debug("the failure that stopped the replica", exc_info=True)
        return 1
    finally:
        if ckpt is not None:
            ckpt.close()
        manager.close()
        if ranks.leader:
            client.close("finished")
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
            emit_step(client.replica_id, r, sampler.cursor, samples, ranks=ranks.size, **heal)
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

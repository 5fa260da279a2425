"""Your own training loop, fault tolerant: phalanx as a library.

    import phalanx

    with phalanx.Replica(model, optimizer, dataset_size=len(data), global_batch_size=64) as r:
        while not r.done:
            r.train_step(compute)   # compute(indices, scale) -> the summed loss

``compute`` runs forward and backward on the samples ``indices`` of this replica's
share, with the summed loss multiplied by ``scale`` (``1 / global_batch_size``)
before backward, and returns the summed loss. Each :meth:`Replica.train_step`:

1. asks the controller for the step's quorum (in the background, while
   ``compute`` runs on the share the last quorum implies);
2. rebuilds the process group when the membership changed, and heals this
   replica from a peer when it is behind (model, optimizer, step, data cursor,
   RNG and any state given to :meth:`Replica.register_state`);
3. runs ``compute`` on this replica's share of the **constant global batch**, in
   micro-batches (a changed share computes only what it adds);
4. all-reduces the gradients, with the commit vote in the same collective;
5. steps the optimizer only if every participant succeeded. Otherwise the step
   is retried with the next quorum, on the same global batch.

So a run with failures trains exactly the global batches of a calm run. The
job's controller, name and config come from the arguments, else from what
``phalanx replica`` (and so ``phalanx run``, the agent, Ray) hands a script it
runs (``[train] script``), else from the environment: ``$PHALANX_CONTROLLER``,
``$PHALANX_REPLICA_NAME``, ``$PHALANX_CONFIG`` (the job TOML), so that a
torchrun-style launcher can start it too.

**From torchft** (the same loop, other names):

============================================  =========================================
torchft                                       phalanx
============================================  =========================================
``Manager(pg, load_state_dict, state_dict,    ``Replica(model, optimizer, ...)``: the
min_replica_size)`` and a lighthouse          controller (``phalanx controller``) forms
                                              quorums; heal state is the model, the
                                              optimizer and :meth:`register_state`
``DistributedDataParallel(manager, model)``   the gradient all-reduce inside
                                              :meth:`train_step` (bucketed, the vote in
                                              the same collective)
``OptimizerWrapper(manager, optimizer)``      :meth:`train_step` steps the optimizer only
                                              on commit (:class:`phalanx.train.FTOptimizer`
                                              for loops that own the order)
``DistributedSampler(replica_rank, ...)``     the constant global batch: ``compute`` gets
                                              this replica's sample indices
``manager.current_step()``                    :attr:`Replica.step`
============================================  =========================================
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from phalanx.env import CONFIG, CONTROLLER, REPLICA_NAME
from phalanx.train.base import JobFinished, StepResult

if TYPE_CHECKING:
    from phalanx.config import JobConfig
    from phalanx.jobs.training import ReplicaSetup

log = logging.getLogger("phalanx.replica")

Compute = Callable[[list[int], float], float]


class Replica:
    """One replica of a phalanx job, around a plain PyTorch model and optimizer.

    Construct it once per process (it registers with the controller and starts the
    heartbeat), call :meth:`train_step` once per loop iteration until :attr:`done`,
    then :meth:`close` (or use it as a context manager). Every replica of the job
    must use the same ``dataset_size``, ``global_batch_size`` and seed."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        dataset_size: int,
        global_batch_size: int,
        micro_batch_size: int = 0,
        steps: int | None = None,
        controller: str | None = None,
        name: str | None = None,
        config: JobConfig | str | Path | None = None,
        checkpoint: str | None = None,
        out: str | Path | None = None,
    ):
        from phalanx.jobs import script

        given = script.current()
        self.cfg = _config(config if config is not None else given.cfg if given else None)
        if checkpoint is not None:
            self.cfg.checkpoint.url = checkpoint
        self.steps = steps if steps is not None else self.cfg.train.steps
        controller = controller or (given.controller if given else None)
        controller = controller or os.environ.get(CONTROLLER)
        if not controller:
            raise ValueError(
                "phalanx.Replica needs the job's controller: got none. Pass controller=URL, "
                f"run the script with phalanx run / phalanx replica, or set ${CONTROLLER}."
            )
        name = name or (given.name if given else None) or os.environ.get(REPLICA_NAME)
        self.name = name or f"policy-{os.getpid()}"
        self.out = Path(out) if out is not None else (given.out if given else None)
        from phalanx.jobs.device import data_plane
        from phalanx.jobs.training import attach_replica, start_checkpoints

        # The model is where the user put it: its collectives follow (NCCL on a GPU
        # unless train.data_plane says gloo).
        device = next(model.parameters()).device
        self._s: ReplicaSetup | None = attach_replica(
            self.cfg,
            controller,
            self.name,
            model,
            optimizer,
            dataset_size=dataset_size,
            global_batch_size=global_batch_size,
            micro_batch_size=micro_batch_size,
            steps=self.steps,
            device=device,
            backend=data_plane(device, self.cfg.train.data_plane),
        )
        self.finished_elsewhere = self._s is None
        self.drained = False
        if self._s is not None:
            start_checkpoints(self.cfg, self._s)
        self._last = time.perf_counter()

    # -- the loop ----------------------------------------------------------

    @property
    def step(self) -> int:
        """The committed step count (healed and resumed steps included)."""
        return self._s.manager.step if self._s is not None else self.steps

    @property
    def done(self) -> bool:
        """Stop training: the job's last step is committed (here, or elsewhere while
        this replica waited), or an operator drained this replica."""
        return self.finished_elsewhere or self.drained or self.step >= self.steps

    @property
    def world_size(self) -> int:
        return self._s.manager.world_size if self._s is not None else 0

    @property
    def manager(self) -> Any:
        """The underlying :class:`phalanx.train.Manager` (for loops that own the order)."""
        return self._s.manager if self._s is not None else None

    def register_state(
        self, name: str, get: Callable[[], Any], set_: Callable[[Any], None]
    ) -> None:
        """State a heal and a checkpoint must carry besides the model and the optimizer
        (an LR scheduler, a data iterator's position): ``get()`` returns it as a tree of
        tensors and JSON scalars, ``set_(value)`` restores it. Register before the first
        :meth:`train_step`, on every replica alike."""
        if self._s is not None:
            self._s.manager.register_state(name, get, set_)

    def train_step(self, compute: Compute) -> StepResult:
        """One fault-tolerant step (module doc). Returns its result: ``committed``
        (the optimizer stepped), the step count, the global batch's mean loss.
        A step that did not commit is retried by the next call, on the same batch."""
        from phalanx.client import QuorumTimeout
        from phalanx.jobs.common import emit_step
        from phalanx.jobs.training import after_commit, emit_retry

        s = self._s
        if s is None or self.done:
            raise RuntimeError("train_step after the job's last step: check Replica.done")
        try:
            r = s.manager.train_step(compute)
        except QuorumTimeout as e:
            log.warning("%s; asking again", e)
            return StepResult(False, s.manager.step, None, 0, 0, error=str(e))
        except JobFinished as e:
            log.info("%s; nothing left to do", e)
            self.finished_elsewhere = True
            return StepResult(False, s.manager.step, None, 0, 0, error=str(e))
        if r.committed:
            s.client.report_progress(loss=r.loss)
            sampler = s.manager.sampler
            cursor, size = (
                (sampler.cursor, sampler.num_samples) if sampler is not None else (0, None)
            )
            samples = s.manager.last_indices if self.cfg.train.log_samples else None
            emit_step(s.client.replica_id, r, cursor, samples, size)
            if after_commit(self.cfg, s, r.step):
                self.drained = True  # the operator's drain: leave at this step
        else:
            emit_retry(s, r.step, r.error)
        return r

    # -- the end -----------------------------------------------------------

    def close(self) -> None:
        """Leave the job: at its last step, make it durable (the checkpoint, if the job
        has a root) and write the final state to ``out`` (the model and optimizer: every
        replica that ends on the last step writes the same bytes); then deregister.
        Idempotent."""
        from phalanx.jobs.training import (
            close_replica,
            emit_drained,
            emit_finished_elsewhere,
            finish_replica,
        )

        s, self._s = self._s, None
        if s is None:
            return
        try:
            if self.drained:
                emit_drained(s)
            elif self.finished_elsewhere or s.manager.step < self.steps:
                emit_finished_elsewhere(s)
            else:
                finish_replica(self.cfg, s, self.out)
        finally:
            close_replica(s)

    def __enter__(self) -> Replica:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _config(config: Any) -> JobConfig:
    from phalanx.config import JobConfig, load_config

    if isinstance(config, JobConfig):
        return config.model_copy(deep=True)
    path = config if config is not None else os.environ.get(CONFIG)
    return load_config(path)

"""Worker processes of ``bench/train_real.py``: one rank of plain DDP, one torchft
replica group, the data and model check, the DiLoCo warm start and the validation
loss of a final state. Each prints JSON lines on stdout (``{"event": "step", "t":
...}`` per committed step, as ``phalanx replica`` does) for the parent to read.

    python bench/train_real_workers.py KIND SPEC_JSON

Every worker trains what the job file ``spec["config"]`` names, through the same
code as a phalanx replica (:func:`phalanx.jobs.task.build`: your model on your data,
its loss, its micro-batches; :func:`phalanx.jobs.mlp.build_optimizer`), with the
same process settings (one torch thread per process, glibc told to keep freed
memory), so that the arms differ only in how they are distributed.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from ft_ddp_workers import emit, torchft_ddp, torchft_manager
from ft_ddp_workers import main as run_worker


def _setup(config: str, wrap: Any = None) -> tuple[Any, Any, Any]:
    """(job config, task, optimizer) of ``config`` on the CPU, as a replica builds
    them; ``wrap`` replaces the model before the optimizer takes its parameters."""
    import torch
    import torch._dynamo  # the first torch.optim constructor imports it: here, not timed

    from phalanx.config import load_config
    from phalanx.jobs import task
    from phalanx.jobs.common import keep_freed_memory
    from phalanx.jobs.mlp import build_optimizer

    emit(event="imported", t=time.time())
    cfg = load_config(config)
    keep_freed_memory()
    torch.set_num_threads(cfg.train.threads)
    job = task.build(cfg.train, cfg.job.seed, torch.device("cpu"), wrap=wrap)
    return cfg, job, build_optimizer(cfg.train, job.model)


def train_share(job: Any, ddp: Any, indices: list[int], micro: int, scale: float) -> float:
    """Forward and backward of ``indices`` in micro-batches of ``micro``; ``ddp``'s
    gradient all-reduce runs once, with the last micro-batch's backward (the others
    under ``no_sync``), as DDP's users accumulate."""
    from phalanx.train.batch import micro_batches

    mbs = micro_batches(indices, micro)
    total = 0.0
    for i, mb in enumerate(mbs):
        ctx = ddp.no_sync() if i < len(mbs) - 1 else contextlib.nullcontext()
        with ctx:
            total += job.compute(mb, scale)
    return total


def _peak_mb() -> float:
    import torch

    from phalanx.train.perf import peak_memory_mb

    return round(peak_memory_mb(torch.device("cpu")), 1)


def worker_ddp(spec: dict[str, Any]) -> None:
    """One rank of ``torch.nn.parallel.DistributedDataParallel`` over a static gloo
    group, ``spec["steps"]`` steps."""
    import torch
    import torch.distributed as dist

    from phalanx.data.sampler import ElasticSampler
    from phalanx.train.batch import split

    rank, world = spec["rank"], spec["world"]
    host, port = spec["store"].rsplit(":", 1)
    base = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(spec["prefix"], base), rank=rank, world_size=world
    )
    cfg, job, opt = _setup(spec["config"], torch.nn.parallel.DistributedDataParallel)
    tc = cfg.train
    gb = tc.global_batch_size
    sampler = ElasticSampler(job.dataset_size, seed=cfg.job.seed)
    off, count = split(gb, world, rank)
    for step in range(1, spec["steps"] + 1):
        opt.zero_grad(set_to_none=True)
        share = sampler.positions(sampler.cursor + off, count)
        # DDP averages over the ranks: world / global batch gives phalanx's gradient
        # (the sum of the samples' losses over the global batch).
        train_share(job, job.model, share, tc.micro_batch_size or count, world / gb)
        opt.step()
        sampler.commit(gb)
        emit(event="step", step=step, participants=world, t=time.time(), peak_mem_mb=_peak_mb())
    dist.destroy_process_group()


def worker_torchft(spec: dict[str, Any]) -> None:
    """One torchft replica group of one process (``Manager``,
    ``DistributedDataParallel``, ``OptimizerWrapper``, as torchft's train_ddp.py),
    each group training a fixed share of the global batch per step."""
    from torchft.optim import OptimizerWrapper

    from phalanx.data.sampler import ElasticSampler
    from phalanx.train.batch import split

    holder: dict[str, Any] = {}

    def state_dict() -> dict[str, Any]:
        return {"model": holder["model"].state_dict(), "optim": holder["opt"].state_dict()}

    def load_state_dict(sd: dict[str, Any]) -> None:
        holder["model"].load_state_dict(sd["model"])
        holder["opt"].load_state_dict(sd["optim"])

    def wrap(model: Any) -> Any:
        holder["model"] = model
        manager, holder["store"] = torchft_manager(
            spec["index"],
            spec["lighthouse"],
            state_dict,
            load_state_dict,
            collective_s=spec["collective_s"],
            timeout_s=spec["timeout_s"],
        )
        holder["manager"] = manager
        return torchft_ddp(manager, model)

    cfg, job, inner = _setup(spec["config"], wrap)
    holder["opt"] = inner
    manager = holder["manager"]
    opt = OptimizerWrapper(manager, inner)
    tc = cfg.train
    gb = tc.global_batch_size
    sampler = ElasticSampler(job.dataset_size, seed=cfg.job.seed)
    off, count = split(gb, spec["replicas"], spec["index"])
    i = 0
    while True:
        opt.zero_grad()  # starts the quorum
        share = sampler.positions(i * gb + off, count)
        # torchft's all-reduce averages over the participants.
        train_share(job, job.model, share, tc.micro_batch_size or count, spec["replicas"] / gb)
        before = manager.current_step()
        opt.step()  # should_commit
        i += 1
        if manager.current_step() > before:
            emit(
                event="step",
                step=manager.current_step(),
                participants=manager.num_participants(),
                t=time.time(),
                peak_mem_mb=_peak_mb(),
            )
        else:
            emit(event="retry", step=manager.current_step(), t=time.time())


def worker_prepare(spec: dict[str, Any]) -> None:
    """Load (and on the first run tokenize and cache) the job's model and data, so
    that no timed arm pays it; report their sizes."""
    import torch

    from phalanx.config import load_config
    from phalanx.jobs import hf_task

    cfg = load_config(spec["config"])
    t0 = time.perf_counter()
    t = hf_task.build(cfg.train, cfg.job.seed, torch.device("cpu"))
    emit(
        event="prepared",
        params=t.params,
        train_samples=len(t.data),
        val_samples=len(t.val) if t.val is not None else 0,
        seq_len=t.data.seq_len,
        seconds=round(time.perf_counter() - t0, 1),
    )


def worker_warmup(spec: dict[str, Any]) -> None:
    """DiLoCo's warm start: ``spec["steps"]`` steps of the job's model with its
    global batch in one process, on samples drawn with another seed than the arms'
    (so the arms do not see them again); saved with its tokenizer to ``spec["out"]``
    (a model directory like the one it came from)."""
    import torch

    from phalanx.config import load_config
    from phalanx.config.model import ModelSection
    from phalanx.data.sampler import ElasticSampler
    from phalanx.jobs import hf_task
    from phalanx.jobs.common import keep_freed_memory
    from phalanx.jobs.mlp import build_optimizer
    from phalanx.train.batch import micro_batches

    cfg = load_config(spec["config"])
    tc = cfg.train
    keep_freed_memory()
    torch.set_num_threads(spec["threads"])
    t = hf_task.build(tc, cfg.job.seed, torch.device("cpu"))
    opt = build_optimizer(tc, t.model)
    gb = tc.global_batch_size
    sampler = ElasticSampler(len(t.data), seed=cfg.job.seed + 1000)
    t0 = time.perf_counter()
    for _ in range(spec["steps"]):
        opt.zero_grad(set_to_none=True)
        for mb in micro_batches(sampler.positions(sampler.cursor, gb), tc.micro_batch_size or gb):
            t.compute(mb, 1.0 / gb)
        opt.step()
        sampler.commit(gb)
    seconds = time.perf_counter() - t0
    val = t.val_loss()
    src = tc.model.path if isinstance(tc.model, ModelSection) else None
    out = Path(spec["out"])
    shutil.copytree(str(src), out, dirs_exist_ok=True)  # the tokenizer and its files
    t.model.save_pretrained(out)
    emit(event="warmup", steps=spec["steps"], seconds=round(seconds, 1), val_loss=val)


def worker_val(spec: dict[str, Any]) -> None:
    """The validation loss (the job's ``data.val_samples`` first validation samples,
    :meth:`HFTask.val_loss`) of each final state in ``spec["files"]`` (a replica's
    ``--out``: ``model.*`` tensors)."""
    import torch
    from safetensors.torch import load_file

    from phalanx.config import load_config
    from phalanx.jobs import hf_task

    cfg = load_config(spec["config"])
    torch.set_num_threads(spec["threads"])
    t = hf_task.build(cfg.train, cfg.job.seed, torch.device("cpu"))
    for f in spec["files"]:
        flat = load_file(f)
        sd = {k.removeprefix("model."): v for k, v in flat.items() if k.startswith("model.")}
        t.model.load_state_dict(sd)
        emit(event="val", file=f, val_loss=t.val_loss())


WORKERS = {
    "ddp": worker_ddp,
    "torchft": worker_torchft,
    "prepare": worker_prepare,
    "warmup": worker_warmup,
    "val": worker_val,
}


def main(argv: list[str]) -> int:
    return run_worker(argv, WORKERS, "train_real_workers.py")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The torchft arm of ``bench/hsdp.py``: torchft 0.2.0's HSDP on the same
model, batch and ranks, in the same run.

torchft 0.2.0 has no ``ft_init_device_mesh`` any more (removed upstream in
meta-pytorch/torchft#289); its HSDP is FSDP2's ``fully_shard`` over each
replica group's own ranks, with FSDP2's all-reduce hook calling the torchft
``Manager``'s fault-tolerant all-reduce across groups (as its ``fsdp_test.py``
and torchtitan do). Here: a ``LighthouseServer`` in this process (min 1
replica, join timeout 0.5 s, heartbeat timeout 4 s), and 2 groups of 2 ranks,
each group under ``torch.distributed.run`` (which stops a group whose rank
dies, as ``phalanx.launch.ranks`` does), gloo, ``ProcessGroupGloo`` with the
same 2 s timeout as phalanx's collective timeout. Each rank trains its 4
samples of the global batch of 16 per step (one micro-batch), AdamW; rank 0
of each group prints one JSON line per committed step.

Figures: ``torchft_step_s`` (group 0's median gap between commits, steps 5
to the kill) and ``torchft_stall_s`` (rank 1 of group 1 SIGKILLed at the
kill step; from the kill to group 0's next commit with 1 participant).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

PY = sys.executable


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(config: str, steps: int) -> int:
    """One rank of a torchft replica group."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed import ReduceOp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    from phalanx.config import load_config
    from phalanx.jobs import task
    from phalanx.jobs.mlp import build_optimizer
    from phalanx.train.batch import split

    cfg = load_config(config)
    tc = cfg.train
    torch.set_num_threads(1)
    group = int(os.environ["REPLICA_GROUP_ID"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    model = task.build_model(tc, cfg.job.seed)
    holder: dict[str, Any] = {}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=cfg.timeouts.collective_s)),
        min_replica_size=1,
        load_state_dict=lambda sd: (
            model.load_state_dict(sd["model"]),
            holder["opt"].load_state_dict(sd["optim"]),
        ),
        state_dict=lambda: {"model": model.state_dict(), "optim": holder["opt"].state_dict()},
        replica_id=f"torchft_{group}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=cfg.timeouts.collective_s),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=30),
        init_sync=False,
    )
    mesh = init_device_mesh("cpu", (world,))
    for m in [*model.blocks, model]:  # type: ignore[union-attr]
        fully_shard(m, mesh=mesh)

    def hook(output: torch.Tensor) -> None:
        manager.allreduce(output, reduce_op=ReduceOp.AVG).wait()

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(hook)
    holder["opt"] = build_optimizer(tc, model)
    opt = OptimizerWrapper(manager, holder["opt"])
    compute = task.make_compute(tc, model, cfg.job.seed, always_forward=True)
    batch = tc.global_batch_size
    while manager.current_step() < steps:
        step = manager.current_step()
        opt.zero_grad()
        off, count = split(batch, 2 * world, 2 * group + rank)  # 4 samples per rank
        idx = [(step * batch + off + i) % tc.dataset_size for i in range(count)]
        compute(idx, 1.0 / batch)
        opt.step()
        if rank == 0 and manager.current_step() > step:
            line = {
                "event": "step",
                "step": manager.current_step(),
                "participants": manager.num_participants(),
                "t": time.time(),
            }
            print(json.dumps(line), flush=True)
    manager.shutdown(wait=False)
    dist.destroy_process_group()
    return 0


def run(work: Path, config: Path, me: str, steps: int, kill_at: int, lines: Any) -> dict[str, Any]:
    """Both figures; ``lines`` is ``bench/hsdp.py``'s JSON-line process class."""
    from torchft.coordination import LighthouseServer

    from phalanx.launch.ranks import rank_pids

    lh = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=500, heartbeat_timeout_ms=4000
    )
    groups = []
    try:
        for g in range(2):
            os.environ["TORCHFT_LIGHTHOUSE"] = lh.address()
            os.environ["REPLICA_GROUP_ID"] = str(g)
            cmd = [PY, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
            cmd += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
            cmd += [me, "--torchft-worker", str(config), str(steps)]
            groups.append(lines(cmd, work / f"torchft-{g}.err"))
        a, b = groups
        b.wait(lambda e: e.get("step", 0) >= kill_at, f"torchft group 1's step {kill_at}")
        t_kill = time.time()
        os.kill(rank_pids(b.p.pid)[1], signal.SIGKILL)
        after = a.wait(
            lambda e: e["event"] == "step" and e["participants"] == 1 and e["t"] > t_kill,
            "torchft group 0's first commit without group 1",
        )
        a.wait(lambda e: e["event"] == "eof", "torchft group 0's end")
        t = {e["step"]: e["t"] for e in a.events if e["event"] == "step"}
        gaps = sorted(t[s] - t[s - 1] for s in range(6, kill_at + 1) if s in t and s - 1 in t)
        return {"torchft_step_s": gaps[len(gaps) // 2], "torchft_stall_s": after["t"] - t_kill}
    finally:
        for p in groups:
            p.kill()
        lh.shutdown()
        os.environ.pop("TORCHFT_LIGHTHOUSE", None)
        os.environ.pop("REPLICA_GROUP_ID", None)

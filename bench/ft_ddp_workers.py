"""Worker processes of ``bench/ft_ddp.py``: one DDP rank, one torchft replica
group, torchft's lighthouse, one side of the heal transfer. Each prints JSON
lines on stdout (``{"event": "step", "t": ...}`` per committed step, as
``phalanx replica`` does) for the parent to read.

    python bench/ft_ddp_workers.py KIND SPEC_JSON

The model, batch and timeouts are here, shared with the parent, so that every
arm trains exactly the same thing.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from collections.abc import Callable
from typing import Any

IN_DIM, HIDDEN, OUT_DIM = 256, [2048, 2048], 256
REPLICAS = 3
GLOBAL_BATCH, MICRO_BATCH = 96, 32
DATASET = 4096
LR = 1e-3
SEED = 0
COLLECTIVE_S, HEARTBEAT_S, JOIN_TIMEOUT_S = 2.0, 4.0, 0.5
HEARTBEAT_INTERVAL_S, SUSPECT_GRACE_S = 0.5, 0.25
HEAL_REPS = 5


def train_section() -> Any:
    from phalanx.config import TrainSection

    return TrainSection(
        steps=10_000_000,
        global_batch_size=GLOBAL_BATCH,
        micro_batch_size=MICRO_BATCH,
        optimizer="adamw",
        lr=LR,
        in_dim=IN_DIM,
        hidden=HIDDEN,
        out_dim=OUT_DIM,
        dataset_size=DATASET,
        threads=1,
    )


def param_count() -> int:
    dims = [IN_DIM, *HIDDEN, OUT_DIM]
    return sum(a * b + b for a, b in itertools.pairwise(dims))


def emit(**event: Any) -> None:
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


# -- workers (each runs in its own process) -------------------------------------

IMPORTS = "import torch, torch._dynamo, phalanx.jobs.ft_ddp"
"""What a replica imports before it does anything. ``torch._dynamo`` is there because
the first ``torch.optim`` constructor imports it (seconds on a loaded machine)."""


def _setup_worker() -> tuple[Any, Any, Any, Any, Any]:
    import torch
    import torch._dynamo  # see IMPORTS

    from phalanx.jobs.mlp import build_data, build_model, build_optimizer

    emit(event="imported", t=time.time())
    torch.set_num_threads(1)
    tc = train_section()
    model = build_model(tc, SEED)
    x, y = build_data(tc, SEED)
    return torch, tc, model, (x, y), build_optimizer(tc, model)


def worker_ddp(spec: dict[str, Any]) -> None:
    """One rank of plain DDP over a static gloo group."""
    torch, _, model, (x, y), opt = _setup_worker()
    import torch.distributed as dist

    from phalanx.data.sampler import ElasticSampler
    from phalanx.train.batch import split

    rank, world = spec["rank"], spec["world"]
    host, port = spec["store"].rsplit(":", 1)
    base = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False)
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(spec["prefix"], base), rank=rank, world_size=world
    )
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    sampler = ElasticSampler(DATASET, seed=SEED)
    off, count = split(GLOBAL_BATCH, world, rank)
    for step in range(1, spec["steps"] + 1):
        opt.zero_grad()
        idx = torch.as_tensor(sampler.positions(sampler.cursor + off, count))
        # Mean over the rank's samples, averaged over ranks by DDP: the same
        # gradient as phalanx's sum scaled by 1 / global batch.
        loss = ((ddp(x[idx]) - y[idx]) ** 2).mean(dim=1).mean()
        loss.backward()
        opt.step()
        sampler.commit(GLOBAL_BATCH)
        emit(event="step", step=step, participants=world, t=time.time())
    dist.destroy_process_group()


def worker_lighthouse(spec: dict[str, Any]) -> None:
    """torchft's lighthouse; ``spec`` may set ``join_timeout_s`` and ``heartbeat_s``
    (default: this benchmark's)."""
    from torchft.coordination import LighthouseServer

    server = LighthouseServer(
        bind="[::]:0",
        min_replicas=1,
        join_timeout_ms=int(spec.get("join_timeout_s", JOIN_TIMEOUT_S) * 1000),
        heartbeat_timeout_ms=int(spec.get("heartbeat_s", HEARTBEAT_S) * 1000),
    )
    emit(event="address", address=server.address())
    while True:
        time.sleep(3600)


def torchft_manager(
    index: int,
    lighthouse: str,
    state_dict: Callable[[], dict[str, Any]],
    load_state_dict: Callable[[dict[str, Any]], None],
    collective_s: float = COLLECTIVE_S,
    timeout_s: float = 10.0,
) -> tuple[Any, Any]:
    """torchft's ``Manager`` of replica group ``index`` (one process), over its
    ``ProcessGroupGloo`` with this benchmark's collective timeout, as in torchft's
    ``train_ddp.py``, and the TCPStore it rendezvouses on (served here: keep it as
    long as the manager). ``timeout_s`` bounds its RPCs and a heal's HTTP transfer."""
    from datetime import timedelta

    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=collective_s)),
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"ft_{index}",
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        timeout=timedelta(seconds=timeout_s),
        init_sync=False,  # every replica builds the same weights
    )
    return manager, store


def torchft_ddp(manager: Any, model: Any) -> Any:
    """torchft 0.2.0's ``DistributedDataParallel`` of ``model`` with one fix.

    When the all-reduce fails (a peer was SIGKILLed) or the manager has already
    errored, its ``_comm_hook`` finds no inner future and raises (``assert
    fut._fut``, or an AttributeError on a ``_DummyWork``'s future), which crashes
    the survivor and leaves DDP's reducer mid-reduction. Here the hook hands the
    bucket back instead: the manager has recorded the error, so
    ``should_commit()`` says no and the step is retried, which is what torchft
    means to happen."""
    import torch
    from torchft import DistributedDataParallel

    def comm_hook(state, bucket):  # unannotated: DDP checks the annotations' types
        work = state.allreduce(bucket.buffer())
        work.wait()
        fut = getattr(work.get_future(), "_fut", None)
        if fut is None:
            emit(event="hook_error", t=time.time())
            done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
            done.set_result(bucket.buffer())
            return done
        return fut

    class FixedDDP(DistributedDataParallel):
        _comm_hook = staticmethod(comm_hook)

    return FixedDDP(manager, model)


def worker_torchft(spec: dict[str, Any]) -> None:
    """One torchft replica group of one process, as in torchft's train_ddp.py."""
    from torchft.optim import OptimizerWrapper

    torch, _, model, (x, y), inner = _setup_worker()  # emits "imported"

    def load_state_dict(sd: dict[str, Any]) -> None:
        model.load_state_dict(sd["model"])
        inner.load_state_dict(sd["optim"])

    def state_dict() -> dict[str, Any]:
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager, _store = torchft_manager(
        spec["index"], spec["lighthouse"], state_dict, load_state_dict
    )
    ddp = torchft_ddp(manager, model)
    opt = OptimizerWrapper(manager, inner)
    per = GLOBAL_BATCH // REPLICAS
    i = 0
    while True:
        opt.zero_grad()
        lo = (i * GLOBAL_BATCH + spec["index"] * per) % (DATASET - per)
        idx = torch.arange(lo, lo + per)
        loss = ((ddp(x[idx]) - y[idx]) ** 2).mean(dim=1).mean()
        loss.backward()
        before = manager.current_step()
        opt.step()
        i += 1
        if manager.current_step() > before:
            emit(
                event="step",
                step=manager.current_step(),
                participants=manager.num_participants(),
                t=time.time(),
            )
        else:
            emit(event="retry", step=manager.current_step(), t=time.time())


def worker_heal(spec: dict[str, Any]) -> None:
    """Rank 0 sends the heal state to rank 1; then both run a plain gloo broadcast
    and a raw send/recv of the same byte count, interleaved, HEAL_REPS times."""
    torch, _, model, (x, y), opt = _setup_worker()
    from phalanx.comm.torch_pg import TorchCommunicator
    from phalanx.comm.transfer import pack, recv_state, send_state
    from phalanx.data.sampler import ElasticSampler
    from phalanx.train.heal import PrefaultedBuffer, expected_state_bytes, received_into
    from phalanx.train.manager import rng_state

    rank = spec["rank"]
    sampler = ElasticSampler(DATASET, seed=SEED)
    idx = torch.arange(GLOBAL_BATCH)
    ((model(x[idx]) - y[idx]) ** 2).mean().backward()
    opt.step()  # AdamW state exists (exp_avg, exp_avg_sq), as in any healed job

    def tree() -> dict[str, Any]:  # what Manager.state_dict() sends
        return {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "step": 1,
            "sampler": sampler.state_dict(),
            "rng": rng_state(),
            "extra": {},
        }

    comm = TorchCommunicator(60.0)
    comm.configure(spec["store"], "heal", rank, 2)
    header, buf = pack(tree())
    nbytes = len(header) + buf.numel()
    # The tensor bytes match on both sides (the JSON header may differ by a digit).
    flat = torch.zeros(buf.numel() // 4, dtype=torch.float32)
    raw = torch.zeros(buf.numel(), dtype=torch.uint8)
    one = torch.zeros(1)

    def timed(fn: Callable[[], Any]) -> float:
        comm.allreduce([one])  # both sides start together
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    timings = "heal heal_fresh prefault load pack broadcast broadcast_fresh p2p"
    out: dict[str, list[float]] = {k: [] for k in timings.split()}
    for _ in range(HEAL_REPS):
        if rank == 0:
            out["heal"].append(timed(lambda: send_state(comm, tree(), 1, tag=1)))
            out["heal_fresh"].append(timed(lambda: send_state(comm, tree(), 1, tag=1)))
            out["broadcast"].append(timed(lambda: comm.broadcast(flat, 0)))
            out["p2p"].append(timed(lambda: comm.send(raw, 1)))
            out["broadcast_fresh"].append(timed(lambda: comm.broadcast(flat, 0)))
            t0 = time.perf_counter()
            pack(tree())
            out["pack"].append(time.perf_counter() - t0)
        else:
            # As the manager does: the joiner fills the buffer while it waits for
            # its quorum (timed apart: it overlaps that wait), then receives into it.
            t0 = time.perf_counter()
            pre = PrefaultedBuffer()
            pre.start(expected_state_bytes(tree(), opt))
            scratch = pre.take()
            out["prefault"].append(time.perf_counter() - t0)
            pre.close()
            got: dict[str, Any] = {}
            out["heal"].append(
                timed(lambda got=got, s=scratch: got.update(recv_state(comm, 0, tag=1, scratch=s)))
            )
            if not received_into(got, scratch):
                raise RuntimeError("the heal did not use the pre-faulted buffer")
            fresh: dict[str, Any] = {}
            out["heal_fresh"].append(
                timed(lambda fresh=fresh: fresh.update(recv_state(comm, 0, tag=1)))
            )
            # Both ranks built the same state from the seed: the received copy must match.
            ok = all(torch.equal(v, got["model"][k]) for k, v in model.state_dict().items())
            for pid, st in opt.state_dict()["state"].items():
                ok = ok and all(
                    torch.equal(v, got["optimizer"]["state"][pid][k]) for k, v in st.items()
                )
            if not ok:
                raise RuntimeError("heal transfer corrupted the state")
            t0 = time.perf_counter()
            model.load_state_dict(got["model"])
            opt.load_state_dict(got["optimizer"])
            out["load"].append(time.perf_counter() - t0)
            out["broadcast"].append(timed(lambda: comm.broadcast(flat, 0)))
            out["p2p"].append(timed(lambda: comm.recv(raw, 0)))
            # Into new memory, as a heal receives: the page faults are part of it.
            out["broadcast_fresh"].append(timed(lambda: comm.broadcast(torch.empty_like(flat), 0)))
    comm.allreduce([one])
    emit(event="heal", rank=rank, bytes=nbytes, **out)
    comm.abort()


WORKERS: dict[str, Callable[[dict[str, Any]], None]] = {
    "ddp": worker_ddp,
    "lighthouse": worker_lighthouse,
    "torchft": worker_torchft,
    "heal": worker_heal,
}


# -- child processes --------------------------------------------------------------


def main(
    argv: list[str],
    workers: dict[str, Callable[[dict[str, Any]], None]] = WORKERS,
    prog: str = "ft_ddp_workers.py",
) -> int:
    """Run the worker ``argv[0]`` of ``workers`` on the JSON spec ``argv[1]``."""
    if len(argv) != 2 or argv[0] not in workers:
        print(f"usage: {prog} {{{','.join(sorted(workers))}}} SPEC_JSON", file=sys.stderr)
        return 2
    workers[argv[0]](json.loads(argv[1]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

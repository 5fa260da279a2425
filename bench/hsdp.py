"""HSDP benchmark: replicas of several ranks (FSDP2 inside, fault tolerance
across) next to plain FSDP2 over the same ranks, same model, same run.

    python bench/hsdp.py [--json] [--steps 40] [--kill-at 20] [--d-model 256]

The model is the built-in job's transformer (``train.model = "transformer"``:
``--layers`` blocks of width ``--d-model``, vocabulary 256, 32 tokens per
sample, float32, AdamW), global batch 16 in micro-batches of 4, one torch
thread per process. Every figure comes from the same invocation:

- ``step_ratio_vs_fsdp``: HSDP's median step time (gaps between consecutive
  commit timestamps of replica ``a``, steps 5 to ``--kill-at``: steady state,
  before any failure) over plain FSDP2's. HSDP: a real controller and 2
  replicas of 2 ranks (``phalanx replica`` under ``phalanx.launch.ranks``),
  FSDP2 over each replica's 2 ranks and the FT manager across them. Plain
  FSDP2: the same 4 ranks in one ``fully_shard`` group, the same global batch,
  no controller, no quorum, no cross-replica all-reduce.
- ``stall_s``: at step ``--kill-at`` of replica ``b``, its rank 1 gets a real
  SIGKILL; from the kill to the survivor ``a``'s next commit (a step it
  commits without ``b``). ``stall_detect_s``: from the kill to ``a``'s
  ``retry`` line (it knows the step failed); ``stall_recover_s``: from there to
  the commit (new quorum and groups, the samples its share gained, the
  all-reduce: the failed attempt's gradients are kept, not computed again).
- ``heal_gbps``: ``b`` is then restarted: a warm standby (a launcher and 2
  ranks started at the beginning, imports paid, waiting for a file) is let go;
  each of its ranks heals its shard (model, AdamW state, step, sampler, RNG)
  from the same rank of ``a``, both shards at once: the replica's bytes
  (``heal_bytes``, both shards) / seconds from the first shard's first bytes
  to the last shard's last (``Manager.last_heal["replica"]``).
  ``gloo_broadcast_gbps``: a plain gloo broadcast of as many bytes between 2
  fresh processes, median of 15. ``heal_ratio`` is the first over the second.
  ``heal_shard_gbps`` / ``heal_shard_ratio``: rank 0's shard alone (its bytes
  over its own transfer, against a gloo broadcast of as many bytes), while
  rank 1's transfer runs beside it on the same cores.
  ``heal_wait_s``: before rank 0's transfer, the wait for the healer to send
  (it learns of the heal with its quorum, after its speculative compute);
  ``heal_s``: rank 0's whole heal, waiting and loading included.
  GB/s means 1e9 bytes per second.
- ``torchft_step_s``, ``torchft_stall_s``, ``step_ratio_vs_torchft``:
  torchft 0.2.0's HSDP on the same model, batch and 2 x 2 ranks, its own
  kill at the same step (``bench/hsdp_torchft.py`` says how).

Timeouts: collective 2 s, heartbeat 4 s (the examples' values).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from phalanx.launch.ranks import rank_pids

PY = sys.executable
GATED = (
    "import os, runpy, sys, time, torch, torch._dynamo, phalanx.jobs.ft_hsdp\n"
    "gate = sys.argv.pop(1)\n"
    "while not os.path.exists(gate):\n"
    "    time.sleep(0.02)\n"
    "runpy.run_module('phalanx.cli', run_name='__main__', alter_sys=True)\n"
)
"""A rank of a warm standby replica: imports done, it runs ``phalanx.cli`` once the
gate file exists."""
VOCAB, SEQ, BATCH, MICRO = 256, 32, 16, 4


def job_toml(path: Path, steps: int, d_model: int, layers: int) -> Path:
    path.write_text(
        f"""[job]
id = "bench-hsdp"
seed = 0
[timeouts]
collective_s = 2.0
heartbeat_s = 4.0
quorum_s = 60.0
heartbeat_interval_s = 0.5
suspect_grace_s = 0.25
[roles.policy]
min_replicas = 1
n_init_replicas = 2
join_timeout_s = 0.5
[replica]
ranks = 2
[train]
model = "transformer"
steps = {steps}
global_batch_size = {BATCH}
micro_batch_size = {MICRO}
lr = 1e-3
vocab = {VOCAB}
seq = {SEQ}
d_model = {d_model}
n_heads = 4
n_layers = {layers}
dataset_size = 4096
"""
    )
    return path


def env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


class Lines:
    """A process whose JSON stdout lines are collected with their arrival time."""

    def __init__(self, cmd: list[str], err: Path):
        with err.open("wb") as f:
            self.p = subprocess.Popen(
                cmd, stdout=subprocess.PIPE, stderr=f, env=env(), start_new_session=True
            )
        self.events: list[dict[str, Any]] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for raw in self.p.stdout:
            line = raw.decode(errors="replace").strip()
            if line.startswith("{"):
                ev = json.loads(line)
                ev["_at"] = time.time()
                with self.cond:
                    self.events.append(ev)
                    self.cond.notify_all()
        with self.cond:
            self.events.append({"event": "eof"})
            self.cond.notify_all()

    def wait(self, pred: Any, what: str, timeout: float = 600.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for e in self.events:
                    if pred(e):
                        return e
                if any(e["event"] == "eof" for e in self.events):
                    raise RuntimeError(f"waiting for {what}, but the process exited")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"waiting for {what}: {timeout} s passed")
                self.cond.wait(0.5)

    def kill(self) -> None:
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait()


def ranks_cmd(n: int, *cmd: str) -> list[str]:
    return [PY, "-m", "phalanx.launch.ranks", "--nproc", str(n), "--", PY, *cmd]


def median_gap(events: list[dict[str, Any]], lo: int, hi: int) -> float:
    t = {e["step"]: e["t"] for e in events if e["event"] == "step"}
    return statistics.median(
        t[s] - t[s - 1] for s in range(lo + 1, hi + 1) if s in t and s - 1 in t
    )


# -- the arms -----------------------------------------------------------------


def fsdp_worker(config: str, steps: int) -> int:
    """One rank of plain FSDP2 over every rank (no FT): the baseline. It trains the
    job file's task (the built-in one, or your model and data) with its global batch
    and micro-batches, the batch split over every rank as HSDP splits it over the
    replicas' ranks. The leader prints a line per step with its peak memory."""
    import torch

    from phalanx.config import load_config
    from phalanx.jobs import task
    from phalanx.jobs.common import keep_freed_memory
    from phalanx.jobs.mlp import build_optimizer
    from phalanx.train.batch import micro_batches, split
    from phalanx.train.hsdp import ReplicaRanks
    from phalanx.train.perf import peak_memory_mb
    from phalanx.train.shards import shard_model

    cfg = load_config(config)
    tc = cfg.train
    keep_freed_memory()  # as a phalanx replica does
    torch.set_num_threads(tc.threads)
    ranks = ReplicaRanks(120.0)
    job = task.build(
        tc,
        cfg.job.seed,
        torch.device("cpu"),
        always_forward=True,
        wrap=lambda m: shard_model(m, ranks.mesh),
    )
    model = job.model
    opt = build_optimizer(tc, model)
    batch = tc.global_batch_size
    for step in range(1, steps + 1):
        off, count = split(batch, ranks.size, ranks.rank)
        start = (step - 1) * batch + off
        idx = [i % job.dataset_size for i in range(start, start + count)]
        for p in model.parameters():
            p.grad = None
        for mb in micro_batches(idx, tc.micro_batch_size or batch):
            job.compute(mb, 1.0 / batch)
        opt.step()
        if ranks.leader:
            line = {"event": "step", "step": step, "t": time.time()}
            line["peak_mem_mb"] = round(peak_memory_mb(torch.device("cpu")), 1)
            print(json.dumps(line), flush=True)
    ranks.close()
    return 0


def bcast_worker(nbytes: int, rounds: int) -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    buf = torch.zeros(nbytes, dtype=torch.uint8)
    for _ in range(rounds):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(buf, 0)
        dt = time.perf_counter() - t0
        if dist.get_rank() == 1:
            print(json.dumps({"event": "bcast", "s": dt}), flush=True)
    dist.destroy_process_group()
    return 0


def peak_rss_mb(pids: list[int]) -> float | None:
    """The largest peak resident set (``VmHWM``, what ``ru_maxrss`` reports to the
    process itself) of ``pids``, in MiB; None where ``/proc`` has none of them."""
    peaks = []
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    peaks.append(int(line.split()[1]) / 1024)
        except OSError:
            continue
    return round(max(peaks), 1) if peaks else None


def fsdp_arm(work: Path, cfg: Path, ranks: int, steps: int, warmup: int = 5) -> dict[str, Any]:
    """Plain FSDP2 over ``ranks`` ranks on the job file ``cfg``, ``steps`` steps: the
    median gap between its steps after ``warmup``, and its leader's peak memory."""
    me = str(Path(__file__).resolve())
    err = work / f"fsdp-{len(list(work.glob('fsdp-*.err')))}.err"
    base = Lines(ranks_cmd(ranks, me, "--fsdp-worker", str(cfg), str(steps)), err)
    last = base.wait(lambda e: e.get("step") == steps, "the FSDP2 baseline")
    base.p.wait()
    return {
        "fsdp_step_s": median_gap(base.events, warmup, steps),
        "fsdp_peak_mem_mb": last.get("peak_mem_mb"),
    }


def hsdp_arm(work: Path, cfg: Path, kill_at: int, warmup: int = 5) -> dict[str, Any]:
    """A real controller and 2 replicas of 2 ranks (``a``, ``b``) on the job file
    ``cfg``, which must run past ``kill_at`` steps; a warm standby for ``b``. At
    ``b``'s step ``kill_at`` its rank 1 is SIGKILLed; the standby is let go once ``b``
    is gone and heals from ``a``. Returns the step time (``a``'s steps ``warmup`` to
    ``kill_at``), the stall, the heal and ``a``'s ranks' peak memory before the kill;
    waits for ``a``'s end."""
    out: dict[str, Any] = {}
    tag = len(list(work.glob("state*")))
    state = work / f"state{tag or ''}"
    ctl_cmd = [PY, "-m", "phalanx.cli", "controller", "--config", str(cfg)]
    ctl = subprocess.Popen(
        [*ctl_cmd, "--state-dir", str(state), "--port", "0"],
        stdout=subprocess.DEVNULL,
        stderr=(work / f"controller{tag or ''}.err").open("wb"),
        env=env(),
        start_new_session=True,
    )
    procs: list[Lines] = []
    try:
        while not (state / "url").exists():
            if ctl.poll() is not None:
                raise RuntimeError(f"the controller exited; see {work}/controller{tag or ''}.err")
            time.sleep(0.05)

        def replica(name: str, gate: Path | None = None) -> Lines:
            head = ["-c", GATED, str(gate)] if gate is not None else ["-m", "phalanx.cli"]
            cmd = ranks_cmd(2, *head, "replica", "--config", str(cfg))
            cmd += ["--controller", str(state), "--name", name]
            p = Lines(cmd, work / f"{name}{tag or ''}-{len(procs)}.err")
            procs.append(p)
            return p

        a, b = replica("a"), replica("b")
        gate = work / f"restart{tag or ''}.go"
        b2 = replica("b", gate)  # a warm standby: its ranks have paid their imports
        b.wait(lambda e: e.get("step", 0) >= kill_at, f"b's step {kill_at}")
        out["hsdp_peak_mem_mb"] = peak_rss_mb(list(rank_pids(a.p.pid).values()))
        t_kill = time.time()
        os.kill(rank_pids(b.p.pid)[1], signal.SIGKILL)
        after = a.wait(
            lambda e: e["event"] == "step" and e["participants"] == 1 and e["t"] > t_kill,
            "a's first commit without b",
        )
        out["stall_s"] = after["t"] - t_kill
        # Where the stall goes: until the survivor knows the step failed (its retry
        # line), then the new quorum, the samples its share gained, the all-reduce.
        # (No retry line: the kill landed between two steps and no attempt failed.)
        retry = next((e for e in a.events if e["event"] == "retry" and e["t"] > t_kill), None)
        failed_at = retry["t"] if retry is not None and retry["t"] < after["t"] else t_kill
        out["stall_detect_s"] = failed_at - t_kill
        out["stall_recover_s"] = after["t"] - failed_at
        b.p.wait()
        gate.touch()
        healed = b2.wait(lambda e: e["event"] == "step" and e.get("healed"), "b's heal")
        heal = healed["heal"]
        whole = heal["replica"]
        out["heal_bytes"], out["heal_transfer_s"] = whole["bytes"], whole["transfer_s"]
        out["heal_gbps"] = whole["bytes"] / whole["transfer_s"] / 1e9
        out["heal_shard_bytes"], out["heal_s"] = heal["bytes"], heal["seconds"]
        out["heal_wait_s"], out["heal_shard_transfer_s"] = heal["wait_s"], heal["transfer_s"]
        out["heal_shard_gbps"] = heal["bytes"] / heal["transfer_s"] / 1e9
        a.wait(lambda e: e["event"] == "done", "a's end")
        out["hsdp_step_s"] = median_gap(a.events, warmup, kill_at)
    finally:
        for p in procs:
            p.kill()
        ctl.kill()
        ctl.wait()
    return out


def broadcast_gbps(work: Path, nbytes: int, rounds: int = 15) -> float:
    """A plain gloo broadcast of ``nbytes`` between 2 fresh processes: GB/s of the
    median of ``rounds`` (after one more that is not counted)."""
    me = str(Path(__file__).resolve())
    err = work / f"bcast-{len(list(work.glob('bcast-*.err')))}.err"
    bc = Lines(ranks_cmd(2, me, "--bcast-worker", str(nbytes), str(rounds + 1)), err)
    bc.p.wait()
    times = [e["s"] for e in bc.events if e["event"] == "bcast"][1:]
    if len(times) != rounds:
        raise RuntimeError(f"the broadcast gave {len(times)} timings of {rounds}; see {err}")
    return nbytes / statistics.median(times) / 1e9


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="bench-hsdp-"))
    cfg = job_toml(work / "job.toml", args.steps, args.d_model, args.layers)
    me = str(Path(__file__).resolve())
    out: dict[str, Any] = {"d_model": args.d_model, "layers": args.layers, "steps": args.steps}
    out.update(fsdp_arm(work, cfg, 4, args.steps))
    out.update(hsdp_arm(work, cfg, args.kill_at))
    out["step_ratio_vs_fsdp"] = out["hsdp_step_s"] / out["fsdp_step_s"]
    for key, nbytes in (("", out["heal_bytes"]), ("_shard", out["heal_shard_bytes"])):
        out[f"gloo_broadcast{key}_gbps"] = broadcast_gbps(work, nbytes)
        out[f"heal{key}_ratio"] = out[f"heal{key}_gbps"] / out[f"gloo_broadcast{key}_gbps"]
    try:
        import hsdp_torchft
    except ImportError as e:  # torchft is in the bench extra; say why it is missing
        out["torchft"] = f"not run: {e}"
        return out
    out.update(hsdp_torchft.run(work, cfg, me, args.steps, args.kill_at, Lines))
    out["step_ratio_vs_torchft"] = out["hsdp_step_s"] / out["torchft_step_s"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=20)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--fsdp-worker", nargs=2, metavar=("CONFIG", "STEPS"), help=argparse.SUPPRESS)
    p.add_argument("--bcast-worker", nargs=2, metavar=("BYTES", "ROUNDS"), help=argparse.SUPPRESS)
    p.add_argument("--torchft-worker", nargs=2, metavar=("CONFIG", "STEPS"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.torchft_worker:
        import hsdp_torchft

        return hsdp_torchft.worker(args.torchft_worker[0], int(args.torchft_worker[1]))
    if args.fsdp_worker:
        return fsdp_worker(args.fsdp_worker[0], int(args.fsdp_worker[1]))
    if args.bcast_worker:
        return bcast_worker(int(args.bcast_worker[0]), int(args.bcast_worker[1]))
    if not 5 < args.kill_at < args.steps - 5:
        p.error(
            f"--kill-at must be in (5, steps - 5): got {args.kill_at} with --steps {args.steps}"
        )
    out = run(args)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>22}  {v:.4g}" if isinstance(v, float) else f"{k:>22}  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

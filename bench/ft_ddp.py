"""FT data-parallel benchmark: phalanx next to plain DDP and torchft, same model,
same machine, same run.

    python bench/ft_ddp.py [--json] [--rounds 3] [--steps 30] [--kills 2] [--no-torchft]
                           [--strict-arm]

Every arm trains the same MLP (the built-in job's model: 256 -> 2048 -> 2048
-> 256, tanh, float32, 5,247,232 parameters) with AdamW on 3 replicas, one
process per replica and one torch thread per process, each replica doing 32
samples per step (global batch 96, micro-batch 32):

- ``ddp``: ``torch.nn.parallel.DistributedDataParallel`` over one static gloo
  group (``init_process_group("gloo")``). No fault tolerance: the baseline.
- ``phalanx``: a real controller (``phalanx controller``) and 3 real replicas
  (``phalanx replica``, the built-in job), i.e. ``Manager.train_step`` with a
  quorum per step, bucketed all-reduce and commit vote, heal on join.
- ``torchft``: torchft's ``Manager`` + ``DistributedDataParallel`` +
  ``OptimizerWrapper`` over its ``ProcessGroupGloo``, a ``LighthouseServer`` in
  its own process, one replica group per process (each with its own TCPStore),
  as in torchft's ``train_ddp.py``.

Figures (the machine is shared and noisy: every figure is set against a
baseline measured in the same run):

- ``step_ratio_vs_ddp``: median step time (gaps between consecutive commit
  timestamps; steady state: all 3 replicas in, after 8 warm-up steps) over
  plain DDP's. Each round runs every arm back to back (the order alternates
  between rounds); the ratio is taken per round, the median over rounds is
  reported. ``cpu_ratio_vs_ddp`` is the same for CPU seconds per replica-step
  (replicas plus their share of the controller / lighthouse), which other
  tenants' load disturbs less than wall time.
- ``stall_s``: in the last round, one replica gets a real SIGKILL mid-run,
  ``--kills`` times (the first just after one of its commits, the others at a
  random point of a step). For each survivor, the largest gap between
  consecutive commits from its last commit before the kill to its 3rd commit
  after it, minus the arm's median step; the max over survivors and kills.
  Measured the same way for torchft.
- ``join_s``: the killed replica is restarted (same name) once the survivors
  have committed 3 steps without it; from its ``Popen`` to its first
  committed step (median over kills). ``join_minus_import_s`` subtracts that
  process's own import
  time (it reports when ``import torch, torch._dynamo, phalanx.jobs.ft_ddp`` is
  done; dynamo is there because the first ``torch.optim`` constructor imports
  it). Fresh-process import times are reported beside it for reference.
- ``heal_gbps``: two processes, the same model plus AdamW state (the tree
  :meth:`Manager.state_dict` sends: model, optimizer, step, sampler, RNG),
  ``phalanx.comm.transfer.send_state`` -> ``recv_state`` over a
  :class:`TorchCommunicator` (gloo): state bytes / receiver's wall time.
  ``gloo_broadcast_gbps``: a plain gloo broadcast of a float32 buffer of the
  same size between the same two processes, interleaved with the heals
  (``gloo_broadcast_fresh_gbps``: the same into newly allocated memory).
  The heal receives into a buffer the receiver faulted in beforehand, as a
  joining manager does while it waits for its first quorum
  (``phalanx.train.heal``); ``prefault_s`` is what filling it took, and
  ``heal_fresh_gbps`` / ``heal_fresh_ratio`` are the same heal into new
  memory. GB/s here means 1e9 bytes per second.
- ``step_ratio_vs_ddp_malloc_tuned``: one more DDP/phalanx pair with glibc
  malloc told to keep freed memory (``MALLOC_ENV``), for both arms alike. Each
  arm also reports ``replica_fault_mb_per_step``: fresh pages mapped per step.

- ``patience_step_ratio`` (with ``--strict-arm``): the phalanx arm's median
  step over one more phalanx arm with ``collective_patience_s = 0``, per round,
  median over rounds: what patient collectives cost a step (the buffers each
  op gets of its own, the commit vote as an all-reduce of its own).

Timeouts are the same knobs with the same values on both FT arms: collective
timeout 2 s, heartbeat timeout 4 s, join timeout 0.5 s (phalanx:
``[timeouts]``/``[roles.policy]``; torchft: ``ProcessGroupGloo(timeout)``,
``LighthouseServer(join_timeout_ms, heartbeat_timeout_ms)``). phalanx also
evicts a peer reported by a survivor after ``suspect_grace_s = 0.25`` without
a heartbeat; torchft has no such report.

torchft 0.2.0's DDP comm hook crashes a survivor whose all-reduce fails (see
``worker_torchft`` in ``ft_ddp_workers.py``); the torchft arm runs it with that one fix, counted in
``failed_allreduce_hook_calls``.

Every child runs in its own session and is killed by process group at the
end; every port comes from binding port 0.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ft_ddp_workers import (
    COLLECTIVE_S,
    DATASET,
    GLOBAL_BATCH,
    HEAL_REPS,
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_S,
    HIDDEN,
    IMPORTS,
    IN_DIM,
    JOIN_TIMEOUT_S,
    LR,
    MICRO_BATCH,
    OUT_DIM,
    REPLICAS,
    SEED,
    SUSPECT_GRACE_S,
    param_count,
)

WARMUP_STEPS = 8
AFTER_KILL = 3
"""Commits each survivor makes after the kill before the victim is restarted;
the stall window ends at the last of them."""
AFTER_JOIN = 5
WAIT_S = 120.0
VICTIM = 2
WORKERS_PY = Path(__file__).resolve().with_name("ft_ddp_workers.py")
CHILD_ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}
for _k in ("PHALANX_TOKEN", "PHALANX_CONTROLLER"):
    CHILD_ENV.pop(_k, None)

REPLICA_MAIN = (
    f"import json, sys, time; {IMPORTS}; "
    "print(json.dumps({'event': 'imported', 't': time.time()}), flush=True); "
    "from phalanx.cli import main; sys.exit(main(sys.argv[1:]))"
)
"""``phalanx replica`` (the real entry point), reporting when its imports are done."""
REPLICA_CMD = [sys.executable, "-c", REPLICA_MAIN, "replica"]


class Child:
    """A subprocess in its own session; JSON lines on its stdout are collected
    (with their arrival time), stderr goes to a file."""

    def __init__(self, args: list[str], log: Path, label: str):
        self.label = label
        self.log = log
        self.events: list[dict[str, Any]] = []
        self.cond = threading.Condition()
        with log.open("wb") as err:
            self.started = time.time()
            self.proc = subprocess.Popen(
                args,
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
                env=CHILD_ENV,
                start_new_session=True,
            )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            ev["_arrived"] = time.time()
            with self.cond:
                self.events.append(ev)
                self.cond.notify_all()
        with self.cond:
            self.cond.notify_all()

    def steps(self) -> list[dict[str, Any]]:
        with self.cond:
            return [e for e in self.events if e.get("event") == "step"]

    def wait(self, pred: Callable[[], Any], what: str, timeout: float = WAIT_S) -> Any:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                v = pred()
                if v:
                    return v
                if self.proc.poll() is not None and self._reader_done():
                    raise RuntimeError(
                        f"{self.label} exited ({self.proc.returncode}) {self.tail()}"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"timed out waiting for {what} {self.tail()}")
                self.cond.wait(min(left, 0.2))

    def _reader_done(self) -> bool:
        return not self._reader.is_alive()

    def tail(self) -> str:
        try:
            return f"[{self.label} stderr: ...{self.log.read_text()[-1500:]}]"
        except OSError:
            return ""

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)


class Children:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.all: list[Child] = []

    def spawn(self, args: list[str], label: str) -> Child:
        c = Child(args, self.tmp / f"{label}.{len(self.all)}.err", label)
        self.all.append(c)
        return c

    def worker(self, kind: str, spec: dict[str, Any], label: str) -> Child:
        return self.spawn([sys.executable, str(WORKERS_PY), kind, json.dumps(spec)], label)

    def stop(self) -> None:
        for c in self.all:
            c.kill(signal.SIGKILL)
        for c in self.all:
            with contextlib.suppress(subprocess.TimeoutExpired):
                c.proc.wait(timeout=10)
        self.all.clear()


@contextlib.contextmanager
def children(tmp: Path) -> Iterator[Children]:
    ch = Children(tmp)
    try:
        yield ch
    finally:
        ch.stop()


@contextlib.contextmanager
def tcp_store() -> Iterator[str]:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    try:
        yield f"127.0.0.1:{store.port}"
    finally:
        del store


# -- measurements --------------------------------------------------------------------


def gaps(ts: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(ts)]


def steady_steps(procs: list[Child], n: int, warmup: int = WARMUP_STEPS) -> Callable[[], bool]:
    """Whether every replica of ``procs`` committed ``warmup + n`` steps with all of
    them in."""

    def ok() -> bool:
        k = len(procs)
        return all(
            len([e for e in p.steps() if e["participants"] == k]) > warmup + n for p in procs
        )

    return ok


def steady_median(
    procs: list[Child], n: int, before: float = float("inf"), warmup: int = WARMUP_STEPS
) -> dict[str, Any]:
    """Median gap between commits over the replicas' steady window: steps with every
    replica in, after the warm-up, ``n`` steps each."""
    pooled: list[float] = []
    for p in procs:
        full = [e["t"] for e in p.steps() if e["participants"] == len(procs) and e["t"] < before]
        pooled += gaps(full[warmup : warmup + n + 1])
    return {"median_step_s": statistics.median(pooled), "gaps": len(pooled)}


def _cpu(pids: list[int]) -> float:
    import psutil

    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
    return total


def _minflt(pids: list[int]) -> int:
    """Minor page faults of the processes (Linux; 0 elsewhere). Each maps a fresh
    4 KiB page: memory the allocator handed back to the OS and takes again."""
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            total += int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])
    return total


def measure_steady(
    procs: list[Child], n: int, what: str, helpers: list[Child], warmup: int = WARMUP_STEPS
) -> dict[str, Any]:
    """Wait for the warm-up (``warmup`` steps) and then ``n`` more steps with every
    replica in; the median step and the CPU time the replicas (and helpers:
    controller, lighthouse) spent per step over that window."""
    procs[0].wait(steady_steps(procs, 0, warmup), f"{what} warm-up")
    reps, helps = [p.proc.pid for p in procs], [h.proc.pid for h in helpers]
    c0, h0, f0, s0 = _cpu(reps), _cpu(helps), _minflt(reps), len(procs[0].steps())
    procs[0].wait(steady_steps(procs, n, warmup), f"{what} steps")
    c1, h1, f1, s1 = _cpu(reps), _cpu(helps), _minflt(reps), len(procs[0].steps())
    out = steady_median(procs, n, warmup=warmup)
    steps = max(1, s1 - s0)
    out["replica_cpu_s_per_step"] = round((c1 - c0) / steps / len(procs), 4)
    # The whole system's CPU per replica-step: the replica's plus its share of the
    # controller's (lighthouse's).
    out["system_cpu_s_per_step"] = round((c1 - c0 + h1 - h0) / steps / len(procs), 4)
    out["replica_fault_mb_per_step"] = round((f1 - f0) * 4096 / 1e6 / steps / len(procs), 2)
    if helpers:
        out["helper_cpu_s_per_step"] = round((h1 - h0) / steps, 4)
    return out


def stall(
    survivors: list[Child], t0: float, t1: float, after: int, median: float
) -> dict[str, Any]:
    """Largest gap between commits from the last one before ``t0`` to the ``after``-th
    one after ``t1`` (>= t0), per survivor, minus the median step; max over survivors."""
    worst = []
    for p in survivors:
        ts = [e["t"] for e in p.steps()]
        end = [t for t in ts if t > t1][:after][-1]
        window = [t for t in ts if t <= t0][-1:] + [t for t in ts if t0 < t <= end]
        worst.append(max(gaps(window)))
    return {"max_gap_s": round(max(worst), 4), "stall_s": round(max(worst) - median, 4)}


def commits_after(p: Child, t0: float) -> int:
    return sum(1 for e in p.steps() if e["t"] > t0)


def kill_cycle(
    procs: list[Child], restart: Callable[[], Child], median: float, delay: float
) -> dict[str, Any]:
    """Wait for the victim's next commit, then ``delay`` s; SIGKILL it; wait for
    AFTER_KILL commits on each survivor; restart it (in ``procs``) and wait for its
    first commit and AFTER_JOIN more commits on the survivors."""
    victim = procs[VICTIM]
    survivors = [p for i, p in enumerate(procs) if i != VICTIM]
    seen = len(victim.steps())
    victim.wait(lambda: len(victim.steps()) > seen, "the victim's next commit")
    time.sleep(delay)
    t_kill = time.time()
    victim.kill(signal.SIGKILL)
    for p in survivors:
        p.wait(lambda p=p: commits_after(p, t_kill) >= AFTER_KILL, "survivor commits after kill")
    time.sleep(max(0.0, t_kill + 1.0 - time.time()))
    joiner = restart()
    procs[VICTIM] = joiner
    first = joiner.wait(lambda: joiner.steps()[:1], "the restarted replica's first commit")[0]
    for p in survivors:
        p.wait(
            lambda p=p: commits_after(p, first["t"]) >= AFTER_JOIN, "survivor commits after join"
        )
    out = stall(survivors, t_kill, t_kill, AFTER_KILL, median)
    join_stall = stall(survivors, joiner.started, first["t"], AFTER_JOIN, median)
    imported = [e["t"] for e in joiner.events if e.get("event") == "imported"]
    import_s = imported[0] - joiner.started if imported else None
    join_s = first["t"] - joiner.started
    return {
        **out,
        "kill_delay_s": round(delay, 3),
        "join_s": round(join_s, 3),
        "join_import_s": round(import_s, 3) if import_s is not None else None,
        "join_minus_import_s": round(join_s - import_s, 3) if import_s is not None else None,
        "join_stall_s": join_stall["stall_s"],
        "_t_kill": t_kill,
        "_joiner": joiner,
        "_survivors": survivors,
    }


def faults(
    procs: list[Child],
    restart: Callable[[], Child],
    median: float,
    kills: int,
    detail: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """``kills`` kill/restart cycles of replica VICTIM. The first kill lands just after
    one of its commits (it dies in its next forward pass, the common case); later
    ones at a random point of a step. ``stall_s`` is the worst cycle's, ``join_s``
    the median over cycles."""
    rng = random.Random(SEED)
    cycles = []
    for i in range(kills):
        c = kill_cycle(procs, restart, median, 0.0 if i == 0 else rng.uniform(0, median))
        if detail is not None:
            c.update(detail(c))
        cycles.append({k: v for k, v in c.items() if not k.startswith("_")})
    med = statistics.median

    def agg(key: str, fn: Callable[[list[float]], float]) -> float | None:
        xs = [c[key] for c in cycles if c.get(key) is not None]
        return round(fn(xs), 3) if xs else None

    return {
        "stall_s": agg("stall_s", max),
        "max_gap_s": agg("max_gap_s", max),
        "join_s": agg("join_s", med),
        "join_import_s": agg("join_import_s", med),
        "join_minus_import_s": agg("join_minus_import_s", med),
        "join_stall_s": agg("join_stall_s", max),
        "survivor_retries": sum(1 for p in procs for e in p.events if e.get("event") == "retry"),
        "victim": VICTIM,
        "kills": cycles,
    }


def run_ddp(ch: Children, steps: int, prefix: str) -> dict[str, Any]:
    with tcp_store() as store:
        procs = [
            ch.worker(
                "ddp",
                {
                    "rank": r,
                    "world": REPLICAS,
                    "store": store,
                    "prefix": prefix,
                    "steps": WARMUP_STEPS + steps + 1,
                },
                f"ddp{r}",
            )
            for r in range(REPLICAS)
        ]
        out = measure_steady(procs, steps, "DDP", [])
        for p in procs:
            p.proc.wait(timeout=30)
    return out


def job_toml(path: Path, patience: bool = True) -> Path:
    """The phalanx arm's job file; ``patience=False``: every collective given up at
    ``collective_s`` (``collective_patience_s = 0``), for the patience's own cost."""
    hidden = ", ".join(str(h) for h in HIDDEN)
    strict = "" if patience else "collective_patience_s = 0\n"
    path.write_text(
        f"""[job]
id = "bench-ft-ddp"
seed = {SEED}

[timeouts]
collective_s = {COLLECTIVE_S}
heartbeat_s = {HEARTBEAT_S}
quorum_s = 60.0
heartbeat_interval_s = {HEARTBEAT_INTERVAL_S}
suspect_grace_s = {SUSPECT_GRACE_S}
{strict}
[roles.policy]
min_replicas = 1
n_init_replicas = {REPLICAS}
join_timeout_s = {JOIN_TIMEOUT_S}

[train]
steps = 10000000
global_batch_size = {GLOBAL_BATCH}
micro_batch_size = {MICRO_BATCH}
optimizer = "adamw"
lr = {LR}
in_dim = {IN_DIM}
hidden = [{hidden}]
out_dim = {OUT_DIM}
dataset_size = {DATASET}
threads = 1
"""
    )
    return path


HEALED = re.compile(r"healed from \S+ to step (\d+) in ([0-9.]+) s \((\d+) model bytes")
LOG_TIME = re.compile(r"^(\d\d):(\d\d):(\d\d\.\d+) ")


def run_phalanx(
    ch: Children,
    tmp: Path,
    steps: int,
    kills: int,
    tag: str,
    patience: bool = True,
    *,
    cfg: Path | None = None,
    replicas: int = REPLICAS,
    warmup: int = WARMUP_STEPS,
) -> dict[str, Any]:
    """A controller and ``replicas`` ``phalanx replica`` processes on this benchmark's
    job (or on the job file ``cfg``): the steady window's figures, then ``kills``
    SIGKILL/restart cycles. The children stay up (``ch`` stops them)."""
    state = tmp / f"ctl-{tag}"
    state.mkdir()
    cfg = cfg or job_toml(tmp / f"job-{tag}.toml", patience)
    ctl = ch.spawn(
        [
            sys.executable,
            "-m",
            "phalanx.cli",
            "controller",
            "--config",
            str(cfg),
            "--state-dir",
            str(state),
        ],
        f"controller-{tag}",
    )
    ctl.wait(lambda: (state / "url").exists(), "the controller's url file", 60)

    def replica(i: int) -> Child:
        return ch.spawn(
            [*REPLICA_CMD, "--config", str(cfg), "--controller", str(state), "--name", f"r{i}"],
            f"phalanx-r{i}-{tag}",
        )

    procs = [replica(i) for i in range(replicas)]
    out = measure_steady(procs, steps, "phalanx", [ctl], warmup)
    if kills:

        def detail(c: dict[str, Any]) -> dict[str, Any]:
            return {
                "kill_timeline": phalanx_kill_timeline(c["_survivors"], c["_t_kill"]),
                "join_timeline": phalanx_join_timeline(c["_joiner"], c["join_s"]),
            }

        out.update(faults(procs, lambda: replica(VICTIM), out["median_step_s"], kills, detail))
    return out


def log_lines(c: Child) -> list[tuple[float, str]]:
    """(epoch time, message) of a phalanx process's stderr log lines (HH:MM:SS.mmm)."""
    day = time.localtime(c.started)
    out = []
    for line in c.log.read_text(errors="replace").splitlines():
        m = LOG_TIME.match(line)
        if not m:
            continue
        h, mi, sec = int(m.group(1)), int(m.group(2)), float(m.group(3))
        t = time.mktime((day.tm_year, day.tm_mon, day.tm_mday, h, mi, 0, 0, 0, -1)) + sec
        if t < c.started - 3600:  # the log crossed midnight
            t += 86400
        out.append((t, line[m.end() :]))
    return out


def _first(lines: list[tuple[float, str]], text: str, after: float = 0.0) -> float | None:
    return next((t for t, msg in lines if text in msg and t >= after), None)


def phalanx_join_timeline(joiner: Child, join_s: float) -> dict[str, Any]:
    """Seconds from the restarted replica's Popen to each stage of its join."""
    t0 = joiner.started
    lines = log_lines(joiner)
    imported = [e["t"] for e in joiner.events if e.get("event") == "imported"]

    def rel(t: float | None) -> float | None:
        return round(t - t0, 3) if t is not None else None

    out: dict[str, Any] = {
        "imports_done": rel(imported[0] if imported else None),
        "registered": rel(_first(lines, "registered")),
        "process_group": rel(_first(lines, "process group for quorum")),
        "healed": rel(_first(lines, "healed from")),
        "first_commit": round(join_s, 3),
    }
    m = HEALED.search(joiner.log.read_text(errors="replace"))
    if m:
        out["heal_s"] = float(m.group(2))
    return out


def phalanx_kill_timeline(survivors: list[Child], t_kill: float) -> dict[str, Any]:
    """Seconds from the SIGKILL to each survivor's failure detection (a collective
    failed: absent when the victim died between collectives and the quorum went on
    without it after ``join_timeout_s``), its process group rebuild, its first
    commit."""
    out: dict[str, Any] = {}
    for i, p in enumerate(survivors):
        lines = log_lines(p)
        failed = _first(lines, "collective failed", t_kill - 0.01)
        rebuilt = _first(lines, "process group for quorum", t_kill)
        commit = next((e["t"] for e in p.steps() if e["t"] > t_kill), None)
        out[f"survivor{i}"] = {
            k: round(v - t_kill, 3) if v is not None else None
            for k, v in (("failed", failed), ("rebuilt", rebuilt), ("commit", commit))
        }
    return out


def run_torchft(ch: Children, steps: int, kills: int) -> dict[str, Any]:
    lh = ch.worker("lighthouse", {}, "lighthouse")
    addr = lh.wait(lambda: [e for e in lh.events if e.get("event") == "address"], "lighthouse")
    addr = addr[0]["address"]

    def replica(i: int) -> Child:
        return ch.worker("torchft", {"index": i, "lighthouse": addr}, f"torchft{i}")

    procs = [replica(i) for i in range(REPLICAS)]
    out = measure_steady(procs, steps, "torchft", [lh])
    if kills:
        out.update(faults(procs, lambda: replica(VICTIM), out["median_step_s"], kills))
        out["failed_allreduce_hook_calls"] = sum(
            1 for p in ch.all for e in p.events if e.get("event") == "hook_error"
        )
    return out


def run_heal(ch: Children) -> dict[str, Any]:
    with tcp_store() as store:
        procs = [ch.worker("heal", {"rank": r, "store": store}, f"heal{r}") for r in range(2)]
        res = [
            p.wait(lambda p=p: [e for e in p.events if e["event"] == "heal"], "heal")[0]
            for p in procs
        ]
    send, recv = res
    nbytes = recv["bytes"]
    med = statistics.median

    def gbps(seconds: list[float]) -> float:
        return round(nbytes / med(seconds) / 1e9, 3)

    return {
        "state_bytes": nbytes,
        "reps": HEAL_REPS,
        "heal_gbps": gbps(recv["heal"]),
        "heal_fresh_gbps": gbps(recv["heal_fresh"]),
        "prefault_s": round(med(recv["prefault"]), 4),
        "gloo_broadcast_gbps": gbps(recv["broadcast"]),
        "gloo_broadcast_fresh_gbps": gbps(recv["broadcast_fresh"]),
        "gloo_p2p_gbps": gbps(recv["p2p"]),
        "heal_s": round(med(recv["heal"]), 4),
        "heal_fresh_s": round(med(recv["heal_fresh"]), 4),
        "broadcast_s": round(med(recv["broadcast"]), 4),
        "broadcast_fresh_s": round(med(recv["broadcast_fresh"]), 4),
        "p2p_s": round(med(recv["p2p"]), 4),
        # What pack() of the same tree costs: the copy send_state used to make.
        "pack_s": round(med(send["pack"]), 4),
        "load_state_dict_s": round(med(recv["load"]), 4),
    }


def import_time(ch: Children, code: str, reps: int = 1) -> float:
    ts = []
    for i in range(reps):
        c = ch.spawn([sys.executable, "-c", code], f"import{i}")
        c.proc.wait(timeout=120)
        ts.append(time.time() - c.started)
    return round(statistics.median(ts), 3)


def torchft_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("torchft")
    except Exception:
        return None


def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torchft": torchft_version(),
        "platform": platform.platform(),
    }
    with contextlib.suppress(ImportError):
        import psutil

        info["mem_gb"] = round(psutil.virtual_memory().total / 1e9, 1)
    return info


MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 30)}
"""glibc malloc told to serve big blocks from the heap and not to hand freed memory
back to the OS: the per-step temporaries (AdamW's are 16 MB each here) then reuse
the same pages instead of faulting fresh ones every step."""


@contextlib.contextmanager
def tuned_malloc() -> Iterator[None]:
    CHILD_ENV.update(MALLOC_ENV)
    try:
        yield
    finally:
        for k in MALLOC_ENV:
            CHILD_ENV.pop(k, None)


def guarded(fn: Callable[[], dict[str, Any]], what: str) -> dict[str, Any]:
    try:
        return fn()
    except Exception as e:
        return {"median_step_s": None, "reason": f"{what} failed: {e}"[:2000]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every arm (default 3)")
    p.add_argument("--steps", type=int, default=30, help="measured steps per arm and round")
    p.add_argument(
        "--kills", type=int, default=2, help="SIGKILL/restart cycles per FT arm (last round)"
    )
    p.add_argument("--no-torchft", action="store_true", help="skip the torchft arm")
    p.add_argument(
        "--no-malloc-check",
        action="store_true",
        help="skip the extra DDP/phalanx pair run with glibc malloc told to keep freed memory",
    )
    p.add_argument("--keep", type=Path, help="keep the children's logs in this (new) directory")
    p.add_argument(
        "--strict-arm",
        action="store_true",
        help="one more phalanx arm with collective_patience_s = 0 (patience_step_ratio)",
    )
    args = p.parse_args(argv)
    t_start = time.time()
    tf = None if args.no_torchft else torchft_version()
    rounds: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stack:
        if args.keep:
            args.keep.mkdir(parents=True)
            tmp = args.keep
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="phalanx-ftddp-")))
        ch = stack.enter_context(children(tmp))
        info = machine()
        heal = run_heal(ch)
        imports = {
            "torch_phalanx_s": import_time(ch, "import torch, phalanx.jobs.ft_ddp"),
            "with_dynamo_s": import_time(ch, IMPORTS),
            "note": "a fresh `python -c` process each, Popen to exit, for reference",
        }
        for r in range(args.rounds):
            kills = args.kills if r == args.rounds - 1 else 0
            arms: dict[str, Callable[[], dict[str, Any]]] = {
                "ddp": lambda r=r: run_ddp(ch, args.steps, f"ddp{r}"),
                "phalanx": lambda r=r, k=kills: run_phalanx(ch, tmp, args.steps, k, str(r)),
            }
            if tf:
                arms["torchft"] = lambda k=kills: run_torchft(ch, args.steps, k)
            if args.strict_arm:
                arms["phalanx_strict"] = lambda r=r: run_phalanx(
                    ch, tmp, args.steps, 0, f"strict{r}", patience=False
                )
            # Alternate the order, so that a drift in the machine's load does not
            # always favour the same arm.
            row: dict[str, Any] = {}
            for name in list(arms) if r % 2 == 0 else list(reversed(arms)):
                row[name] = guarded(arms[name], name)
                ch.stop()
            rounds.append(row)
        alloc = None
        if not args.no_malloc_check:
            with tuned_malloc():
                alloc = {
                    "ddp": guarded(lambda: run_ddp(ch, args.steps, "ddp-malloc"), "ddp"),
                    "phalanx": guarded(
                        lambda: run_phalanx(ch, tmp, args.steps, 0, "malloc"), "phalanx"
                    ),
                }
                ch.stop()
    result = summarize(rounds, heal, imports, info, tf, args, alloc)
    result["runtime_s"] = round(time.time() - t_start, 1)
    if args.json:
        print(json.dumps(result))
    else:
        table(result)
    return 0


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def summarize(
    rounds: list[dict[str, Any]],
    heal: dict[str, Any],
    imports: dict[str, float],
    info: dict[str, Any],
    tf: str | None,
    args: argparse.Namespace,
    alloc: dict[str, Any] | None,
) -> dict[str, Any]:
    def arm(name: str) -> list[float | None]:
        return [r.get(name, {}).get("median_step_s") for r in rounds]

    ddp, ours, theirs = arm("ddp"), arm("phalanx"), arm("torchft")
    ratios = [x for x in map(_ratio, ours, ddp) if x is not None]

    def cpu_ratio(name: str) -> float | None:
        rs = [
            _ratio(r[name].get("system_cpu_s_per_step"), r["ddp"].get("system_cpu_s_per_step"))
            for r in rounds
            if name in r
        ]
        rs = [x for x in rs if x is not None]
        return round(statistics.median(rs), 3) if rs else None

    tf_ratios = [x for x in map(_ratio, theirs, ddp) if x is not None]
    last = rounds[-1]
    ph, tfl = last["phalanx"], last.get("torchft", {})
    heal_ratio = _ratio(heal["heal_gbps"], heal["gloo_broadcast_gbps"])
    join = ph.get("join_s")
    out: dict[str, Any] = {
        "step_ratio_vs_ddp": round(statistics.median(ratios), 3) if ratios else None,
        "cpu_ratio_vs_ddp": cpu_ratio("phalanx"),
        "stall_s": ph.get("stall_s"),
        "join_s": join,
        "join_minus_import_s": ph.get("join_minus_import_s"),
        "heal_gbps": heal["heal_gbps"],
        "gloo_broadcast_gbps": heal["gloo_broadcast_gbps"],
        "heal_ratio": heal_ratio,
        "heal_fresh_gbps": heal["heal_fresh_gbps"],
        "heal_fresh_ratio": _ratio(heal["heal_fresh_gbps"], heal["gloo_broadcast_gbps"]),
        "prefault_s": heal["prefault_s"],
        "torchft_step_ratio_vs_ddp": round(statistics.median(tf_ratios), 3) if tf_ratios else None,
        "torchft_cpu_ratio_vs_ddp": cpu_ratio("torchft"),
        "torchft_stall_s": tfl.get("stall_s"),
        "torchft_join_s": tfl.get("join_s"),
        "torchft_join_minus_import_s": tfl.get("join_minus_import_s"),
    }
    strict = [x for x in map(_ratio, ours, arm("phalanx_strict")) if x is not None]
    if strict:
        # The patience's own cost per step (private buffers, the vote an op of its
        # own): the phalanx arm over the same job with collective_patience_s = 0.
        out["patience_step_ratio"] = round(statistics.median(strict), 3)
        out["patience_step_ratios"] = strict
    goals = {
        "step_ratio_vs_ddp <= 1.05": _goal(out["step_ratio_vs_ddp"], lambda v: v <= 1.05),
        "stall_s <= 0.5": _goal(out["stall_s"], lambda v: v <= 0.5),
        "stall_s < torchft_stall_s": _goal(
            out["stall_s"],
            lambda v: out["torchft_stall_s"] is not None and v < out["torchft_stall_s"],
        ),
        "heal_ratio >= 0.7": _goal(heal_ratio, lambda v: v >= 0.7),
    }
    if out["torchft_stall_s"] is None:
        goals["stall_s < torchft_stall_s"] = None
    out["goals_met"] = goals
    out["per_round"] = []
    for row, d, o, t in zip(rounds, ddp, ours, theirs, strict=True):
        per: dict[str, Any] = {
            "ddp_step_s": _r(d),
            "phalanx_step_s": _r(o),
            "torchft_step_s": _r(t),
            "phalanx_ratio": _ratio(o, d),
            "torchft_ratio": _ratio(t, d),
        }
        for name, res in row.items():
            for k in ("system_cpu_s_per_step", "replica_fault_mb_per_step"):
                if res.get(k) is not None:
                    per[f"{name}_{k}"] = res[k]
        out["per_round"].append(per)
    out["phalanx"] = {k: v for k, v in ph.items() if k != "gaps"}
    out["ddp"] = {k: v for k, v in last["ddp"].items() if k != "gaps"}
    if tf:
        out["torchft"] = {k: v for k, v in tfl.items() if k != "gaps"}
    else:
        out["torchft"] = {"median_step_s": None, "reason": "torchft is not installed"}
    if alloc is not None:
        d, o = alloc["ddp"], alloc["phalanx"]
        out["step_ratio_vs_ddp_malloc_tuned"] = _ratio(
            o.get("median_step_s"), d.get("median_step_s")
        )
        out["malloc_tuned"] = {
            "env": MALLOC_ENV,
            "ddp": {k: v for k, v in d.items() if k != "gaps"},
            "phalanx": {k: v for k, v in o.items() if k != "gaps"},
        }
    out["heal"] = heal
    out["imports"] = imports
    out["model"] = {
        "params": param_count(),
        "dims": [IN_DIM, *HIDDEN, OUT_DIM],
        "dtype": "float32",
        "optimizer": "adamw",
        "replicas": REPLICAS,
        "threads_per_replica": 1,
        "global_batch": GLOBAL_BATCH,
        "micro_batch": MICRO_BATCH,
        "steps_measured": args.steps,
        "warmup_steps": WARMUP_STEPS,
        "rounds": args.rounds,
    }
    out["timeouts"] = {
        "collective_s": COLLECTIVE_S,
        "heartbeat_s": HEARTBEAT_S,
        "join_timeout_s": JOIN_TIMEOUT_S,
        "phalanx_heartbeat_interval_s": HEARTBEAT_INTERVAL_S,
        "phalanx_suspect_grace_s": SUSPECT_GRACE_S,
    }
    out["units"] = {"*_gbps": "GB/s, 1e9 bytes per second", "*_s": "seconds"}
    out["machine"] = info
    return out


def _r(v: float | None) -> float | None:
    return round(v, 4) if v is not None else None


def _goal(v: Any, ok: Callable[[Any], bool]) -> bool | None:
    return None if v is None else bool(ok(v))


def table(r: dict[str, Any]) -> None:
    m = r["model"]
    print(
        f"model: {m['params']:,} params {m['dims']}, {m['replicas']} replicas x 1 thread, "
        f"global batch {m['global_batch']}, {m['rounds']} rounds x {m['steps_measured']} steps"
    )
    print(
        f"{'round':>5} {'ddp s':>8} {'phalanx s':>10} {'torchft s':>10} {'ph/ddp':>7} {'tf/ddp':>7}"
    )
    for i, row in enumerate(r["per_round"]):
        cells = [row[k] for k in ("ddp_step_s", "phalanx_step_s", "torchft_step_s")]
        cells += [row["phalanx_ratio"], row["torchft_ratio"]]
        print(f"{i:>5} " + " ".join(f"{'-' if c is None else c!s:>9}" for c in cells))
    print()
    for k in (
        "step_ratio_vs_ddp",
        "cpu_ratio_vs_ddp",
        "torchft_step_ratio_vs_ddp",
        "torchft_cpu_ratio_vs_ddp",
        "stall_s",
        "torchft_stall_s",
        "join_s",
        "join_minus_import_s",
        "torchft_join_s",
        "torchft_join_minus_import_s",
        "step_ratio_vs_ddp_malloc_tuned",
        "heal_gbps",
        "gloo_broadcast_gbps",
        "heal_ratio",
        "heal_fresh_ratio",
        "prefault_s",
    ):
        print(f"{k:>30}: {r.get(k)}")
    print("\ngoals:", ", ".join(f"{k}: {v}" for k, v in r["goals_met"].items()))
    for arm in ("phalanx", "torchft"):
        if r[arm].get("reason"):
            print(f"{arm}: {r[arm]['reason']}")
    mi = r["machine"]
    print(f"\n{mi['cpu']}, {mi['cores']} cores, torch {mi['torch']}, torchft {mi['torchft']}")
    print(f"runtime {r['runtime_s']} s")


if __name__ == "__main__":
    sys.exit(main())

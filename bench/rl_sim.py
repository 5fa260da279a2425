"""RL control-plane scaling: the controller's prompt-lease / rollout-ledger path
with N simulated rollout replicas, against the ideal of zero control-plane cost.

    python bench/rl_sim.py [--json] [--replicas 8,32,64] [--delay-s 0.25] [--seconds 10]
                           [--procs 2] [--no-reference] [--profile-dir DIR]

``bench/rl.py`` calls :func:`run_sim`; run alone, this prints a table (or,
with ``--json``, one JSON object ``{"sim": {...}}``).

For each N (and N = 1 as the reference) a fresh controller (``python -m
phalanx.cli controller``, port 0, temp state dir) runs an RL job, driven by
N + 1 threads, each with its own real :class:`~phalanx.client.ControllerClient`
(registered, heartbeating once a second). The N rollout replicas are spread
over ``--procs`` load processes (default 2): a real replica is a process of
its own, and N clients queueing on one GIL would add latency that belongs
to the load generator, not to the controller. The policy replica runs in
the calling process.

- a **rollout replica** loops: ``lease_prompts`` (``prompts_per_lease`` = 4),
  sleeps ``delay_s`` per leased prompt (simulated generation; no model, no
  torch), then ``submit_rollouts`` with ``group_size`` = 16 fake completions
  per prompt (1-5 tokens, log-probs <= 0, ``exact_match`` 0 so the job never
  reaches its target). A weight-sync order in a reply is answered at once
  with ``sync_done(ok=True)`` at the reply's ``policy_step`` (no weights
  move). Replicas start at random phases of one lease cycle.
- the **policy replica** takes one quorum (so it is the sync leader), then
  loops ``lease_batch(step)`` until it gets the batch, ``ack_batch(step + 1)``,
  with no training in between, answering sync orders the same way.

The job: ``grpo.prompts_per_step = max(16, N)``, ``inner_epochs = 2`` and
``loop.sync_every = 2`` (the defaults), ``loop.max_ahead`` large enough that
backpressure never holds a replica back (room for twice the prompts all
replicas lease at once), and ``loop.max_staleness`` effectively unbounded:
with zero-time training the policy steps several times per lease cycle, so
the default staleness bound would discard rollouts for reasons that belong
to the RL loop's settings, not to the control plane measured here.

Figures, over ``seconds`` after ``warmup_s``:

- ``rollouts_per_s``: rollouts the controller accepted. Each submission's
  rollouts are spread over its lease cycle (end of the previous submission
  to the end of this one) and counted pro rata inside the window, so that a
  replica's phase does not quantise the count (it matters at N = 1).
- ``ideal_per_s`` = N / ``delay_s``; ``efficiency`` = the ratio of the two
  (the project's goal: >= 0.9 at N = 64); ``efficiency_vs_n1``: over N = 1's.
- ``lease_p50_ms`` / ``lease_p99_ms``: ``lease_prompts`` calls that returned
  a lease, as the replica sees them (so they include the load process's own
  GIL waits); ``submit_*`` likewise. ``overhead_ms_per_cycle``: the mean
  lease cycle's time beyond ``delay_s`` x prompts, split into the lease,
  the sync report (``sync_done``; 0 in cycles without a sync order), the
  submission and the sleep's overshoot (the load process's scheduling lag).
- ``controller_cpu_s`` / ``_percent``: the controller process (100 % = one
  core); ``loadgen_cpu_percent``: the load processes and the policy's;
  ``others_cpu_percent``: the rest of the machine (other tenants of a shared
  box), from ``/proc/stat``, over the same window. With it near the core
  count, the latencies measure the box's run queue more than the controller.
- ``ledger_ok``: the controller's own invariant (``status()["rl"]["ok"]``)
  after every replica submitted its last lease; ``lost`` counts prompts
  issued but neither accepted nor queued, and ``accepted_matches`` checks
  the controller's accepted count against the replicas' (no rollout lost,
  none duplicated, discarded or expired).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing as mp
import os
import platform
import random
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from phalanx.client import ControllerClient
from phalanx.protocol.rl import Completion, RolloutIn

GROUP_SIZE = 16
PROMPTS_PER_LEASE = 4
LEASE_WAIT_S = 1.0
TARGET_EFFICIENCY = 0.9
TARGET_AT = 64
START_TIMEOUT_S = 60.0


# -- the controller --------------------------------------------------------------


def job_toml(n: int) -> str:
    pps = max(16, n)
    max_ahead = math.ceil(2 * n * PROMPTS_PER_LEASE / pps) + 2
    return (
        f'[job]\nid = "rl-sim-n{n}"\n\n'
        "[roles.policy]\nmin_replicas = 1\nn_init_replicas = 1\n\n"
        "[roles.rollout]\nmin_replicas = 1\nn_init_replicas = 1\n\n"
        f"[rl.grpo]\nsteps = 10000000\nprompts_per_step = {pps}\ngroup_size = {GROUP_SIZE}\n\n"
        f"[rl.loop]\nprompts_per_lease = {PROMPTS_PER_LEASE}\nmax_ahead = {max_ahead}\n"
        "max_staleness = 1000000\nsync_every = 2\n"
    )


@contextlib.contextmanager
def controller(tmp: Path, n: int, profile_dir: Path | None = None) -> Iterator[tuple[Path, int]]:
    """A real controller subprocess (own session) on port 0; yields (state dir, pid).
    Stopped by its pid on exit."""
    state = tmp / f"n{n}"
    state.mkdir()
    cfg = tmp / f"job-n{n}.toml"
    cfg.write_text(job_toml(n))
    cmd = [sys.executable, "-m", "phalanx.cli", "controller", "--state-dir", str(state)]
    if profile_dir is not None:
        profile_dir.mkdir(parents=True, exist_ok=True)
        cmd[1:1] = ["-m", "cProfile", "-o", str(profile_dir / f"rl-sim-n{n}.prof")]
    env = {k: v for k, v in os.environ.items() if k != "PHALANX_TOKEN"}
    with (tmp / f"controller-n{n}.log").open("wb") as log:
        proc = subprocess.Popen(
            [*cmd, "--config", str(cfg), "--port", "0"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ((state / "url").exists() and (state / "token").exists()):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (tmp / f"controller-n{n}.log").read_text()[-2000:]
                raise RuntimeError(f"controller did not start (rc {proc.returncode}):\n{tail}")
            time.sleep(0.05)
        yield state, proc.pid
    finally:
        if proc.poll() is None:
            # SIGINT under cProfile: uvicorn re-raises SIGTERM after its shutdown,
            # which would end the profiled run before it writes its stats.
            proc.send_signal(signal.SIGTERM if profile_dir is None else signal.SIGINT)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def proc_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (psutil where installed)."""
    try:
        import psutil
    except ImportError:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def self_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy (all cores, all tenants), from /proc/stat."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except OSError:
        return math.nan
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    return (sum(ticks[:8]) - idle) / os.sysconf("SC_CLK_TCK")


# -- simulated replicas ----------------------------------------------------------


@dataclass
class Cycle:
    """One lease cycle of a rollout replica, on the monotonic clock."""

    start: float
    lease_s: float
    sync_s: float
    sleep_s: float
    asked_sleep_s: float
    submit_s: float
    end: float
    submitted: int
    accepted: int


@dataclass
class RolloutStats:
    started: float = 0.0
    cycles: list[Cycle] = field(default_factory=list)
    empty_leases: int = 0
    syncs: int = 0
    submitted: int = 0
    accepted: int = 0
    error: Exception | None = None


def fake_group(rng: random.Random) -> list[Completion]:
    """``GROUP_SIZE`` completions shaped like the sort4 task's: 5 prompt tokens,
    1-5 completion tokens with log-probs <= 0."""
    out = []
    for _ in range(GROUP_SIZE):
        k = rng.randint(1, 5)
        out.append(
            Completion(
                prompt_ids=[rng.randint(0, 11) for _ in range(5)],
                token_ids=[rng.randint(0, 11) for _ in range(k)],
                logprobs=[-round(rng.uniform(0.01, 3.0), 4) for _ in range(k)],
                finished=True,
                reward=round(rng.random(), 4),
            )
        )
    return out


def rollout_loop(
    c: ControllerClient, delay_s: float, stop: threading.Event, stats: RolloutStats, seed: int
) -> None:
    rng = random.Random(seed)
    group = fake_group(rng)  # the same payload every time: building it is not measured
    try:
        time.sleep(rng.uniform(0, delay_s * PROMPTS_PER_LEASE))
        # No weights yet: ask without waiting, the reply says whether to build version 0.
        r = c.lease_prompts(-1, PROMPTS_PER_LEASE, 0.0)
        version = 0 if r.init_weights else -1
        stats.started = time.monotonic()
        while not stop.is_set() and not r.finished:
            t0 = time.monotonic()
            r = c.lease_prompts(version, PROMPTS_PER_LEASE, LEASE_WAIT_S)
            t1 = time.monotonic()
            if r.sync:
                c.sync_done(r.sync.seq, version=r.policy_step, ok=True)
                version = r.policy_step
                stats.syncs += 1
            elif r.init_weights and version < 0:
                version = 0
            t2 = time.monotonic()
            lease = r.lease
            if lease is None:
                stats.empty_leases += 1
                continue
            asked = delay_s * len(lease.prompts)
            time.sleep(asked)
            t3 = time.monotonic()
            # The group was checked once when it was built: not again per submission.
            rollouts = [
                RolloutIn.model_construct(
                    rollout_id=p.rollout_id,
                    version=version,
                    reward=0.5,
                    exact_match=0.0,
                    completions=group,
                    ref=None,
                )
                for p in lease.prompts
            ]
            out = c.submit_rollouts(lease.lease_id, rollouts)
            t4 = time.monotonic()
            n_ok = len(out.accepted)
            stats.submitted += len(rollouts)
            stats.accepted += n_ok
            stats.cycles.append(
                Cycle(t0, t1 - t0, t2 - t1, t3 - t2, asked, t4 - t3, t4, len(rollouts), n_ok)
            )
    except Exception as e:  # reported to the coordinator, which fails the run
        stats.error = e


@dataclass
class PolicyStats:
    steps: int = 0
    syncs: int = 0
    error: Exception | None = None


def policy_loop(c: ControllerClient, stop: threading.Event, stats: PolicyStats) -> None:
    try:
        c.quorum(0)  # rank 0 of the newest policy quorum leads the weight syncs
        step = 0
        while not stop.is_set():
            r = c.lease_batch(step, LEASE_WAIT_S)
            if r.sync:
                c.sync_done(r.sync.seq, version=step, ok=True)
                stats.syncs += 1
            if r.finished:
                return
            if r.batch is None:
                continue
            a = c.ack_batch(step + 1)
            step += 1
            stats.steps = step
            if a.sync:
                c.sync_done(a.sync.seq, version=step, ok=True)
                stats.syncs += 1
    except Exception as e:  # reported to the coordinator, which fails the run
        stats.error = e


# -- one N -----------------------------------------------------------------------


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1e3, 2)


def _rate(stats: list[RolloutStats], a: float, b: float) -> float:
    """Accepted rollouts per second in [a, b], each submission spread over its cycle."""
    total = 0.0
    for s in stats:
        prev = s.started
        for cy in s.cycles:
            overlap = max(0.0, min(b, cy.end) - max(a, prev))
            if cy.end > prev:
                total += cy.accepted * overlap / (cy.end - prev)
            prev = cy.end
    return total / (b - a)


def replica_worker(conn: Any, state_dir: str, first: int, count: int, delay_s: float) -> None:
    """A load process: rollout replicas ``first .. first + count - 1``, one thread each.
    Protocol over ``conn``: sends "ready" once all are registered and heartbeating,
    starts them on "go", lets them finish their lease on "stop", then sends
    ("done", stats, error) and leaves (closing its clients)."""
    clients = [
        ControllerClient(state_dir, "rollout", f"rollout-{i}") for i in range(first, first + count)
    ]
    try:
        for c in clients:
            c.start_heartbeat()  # registers first
        conn.send("ready")
        conn.recv()
        stop = threading.Event()
        stats = [RolloutStats() for _ in clients]
        threads = [
            threading.Thread(
                target=rollout_loop, args=(c, delay_s, stop, s, first + i), daemon=True
            )
            for i, (c, s) in enumerate(zip(clients, stats, strict=True))
        ]
        for t in threads:
            t.start()
        conn.recv()
        stop.set()  # each replica submits the lease it holds, then stops
        for t in threads:
            t.join(timeout=delay_s * PROMPTS_PER_LEASE + 60)
        errors = [repr(s.error) for s in stats if s.error is not None]
        errors += [f"{t.name} did not stop" for t in threads if t.is_alive()]
        # Plain data over the pipe: classes of a script's __main__ do not unpickle
        # in the parent.
        plain = [asdict(replace(s, error=None)) for s in stats]
        conn.send(("done", plain, errors[0] if errors else None))
    finally:
        # In parallel: each close waits for its heartbeat's held long-poll.
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda c: c.close(reason=None), clients))


def _expect(conn: Any, proc: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError(f"a load process exited ({proc.exitcode}) before sending {what!r}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"a load process sent no {what!r} within {timeout:.0f} s")
    return conn.recv()


def bench_one(
    tmp: Path,
    n: int,
    delay_s: float,
    seconds: float,
    warmup_s: float,
    procs: int,
    profile_dir: Path | None,
) -> dict[str, Any]:
    row: dict[str, Any] = {"replicas": n, "load_procs": min(procs, n)}
    row["loadavg_1m"] = round(os.getloadavg()[0], 2)
    ctx = mp.get_context("spawn")
    with controller(tmp, n, profile_dir) as (state, pid):
        policy = ControllerClient(str(state), "policy", "policy-0")
        pipes, workers = [], []
        try:
            for k in range(min(procs, n)):
                first, last = k * n // min(procs, n), (k + 1) * n // min(procs, n)
                mine, theirs = ctx.Pipe()
                w = ctx.Process(
                    target=replica_worker,
                    args=(theirs, str(state), first, last - first, delay_s),
                    daemon=True,
                )
                w.start()
                pipes.append(mine)
                workers.append(w)
            for conn, w in zip(pipes, workers, strict=True):
                _expect(conn, w, START_TIMEOUT_S, "ready")
            policy.start_heartbeat()
            policy_stop, pstats = threading.Event(), PolicyStats()
            pt = threading.Thread(target=policy_loop, args=(policy, policy_stop, pstats))
            pt.daemon = True
            pt.start()
            for conn in pipes:
                conn.send("go")
            gen = [pid_ for w in workers if (pid_ := w.pid) is not None]

            def load_cpu() -> float:
                return self_cpu_s() + sum(proc_cpu_s(p) for p in gen)

            time.sleep(warmup_s)
            a, cpu_a, gen_a, all_a = time.monotonic(), proc_cpu_s(pid), load_cpu(), machine_busy_s()
            time.sleep(seconds)
            b, cpu_b, gen_b, all_b = time.monotonic(), proc_cpu_s(pid), load_cpu(), machine_busy_s()
            for conn in pipes:
                conn.send("stop")
            done = [
                _expect(conn, w, delay_s * PROMPTS_PER_LEASE + 90, "done")
                for conn, w in zip(pipes, workers, strict=True)
            ]
            policy_stop.set()
            pt.join(timeout=30)
            errors = [d[2] for d in done if d[2]] + ([repr(pstats.error)] if pstats.error else [])
            if errors:
                raise RuntimeError(f"a simulated replica failed: {errors[0]}")
            st = policy.status()
            if st.rl is None:
                raise RuntimeError("the controller ran no RL ledger")
            rl = st.rl
            for w in workers:
                w.join(timeout=30)
        finally:
            policy.close(reason=None)
            for w in workers:
                if w.is_alive() and w.pid is not None:
                    os.kill(w.pid, signal.SIGKILL)
                    w.join(timeout=5)

    rstats = [
        RolloutStats(**{**s, "cycles": [Cycle(**c) for c in s["cycles"]]})
        for d in done
        for s in d[1]
    ]
    cyc = [cy for s in rstats for cy in s.cycles if a <= cy.start and cy.end <= b]
    ideal = n / delay_s
    rate = _rate(rstats, a, b)
    per = max(1, len(cyc))
    over = {
        "lease": sum(cy.lease_s for cy in cyc) / per,
        "sync": sum(cy.sync_s for cy in cyc) / per,
        "submit": sum(cy.submit_s for cy in cyc) / per,
        "oversleep": sum(cy.sleep_s - cy.asked_sleep_s for cy in cyc) / per,
    }
    accepted = sum(s.accepted for s in rstats)
    pr, ro = rl.prompts, rl.rollouts
    row.update(
        {
            "rollouts_per_s": round(rate, 2),
            "ideal_per_s": round(ideal, 2),
            "efficiency": round(rate / ideal, 4),
            "lease_p50_ms": _ms(_pct([cy.lease_s for cy in cyc], 50)),
            "lease_p99_ms": _ms(_pct([cy.lease_s for cy in cyc], 99)),
            "submit_p50_ms": _ms(_pct([cy.submit_s for cy in cyc], 50)),
            "submit_p99_ms": _ms(_pct([cy.submit_s for cy in cyc], 99)),
            "overhead_ms_per_cycle": {k: _ms(v) for k, v in over.items()},
            "cycles": len(cyc),
            "controller_cpu_s": round(cpu_b - cpu_a, 3),
            "controller_cpu_percent": round(100 * (cpu_b - cpu_a) / (b - a), 1),
            "loadgen_cpu_percent": round(100 * (gen_b - gen_a) / (b - a), 1),
            # Everything else on this shared machine (other tenants), same window.
            "others_cpu_percent": round(
                100 * ((all_b - all_a) - (cpu_b - cpu_a) - (gen_b - gen_a)) / (b - a), 1
            ),
            "policy_steps": pstats.steps,
            "syncs": pstats.syncs,
            "empty_leases": sum(s.empty_leases for s in rstats),
            "ledger_ok": rl.ok,
            "accepted_total": accepted,
            "accepted_matches": ro.accepted == accepted == sum(s.submitted for s in rstats)
            and not ro.discarded
            and ro.duplicates_dropped == 0
            and rl.leases.expired == 0,
            "lost": pr.issued - ro.accepted - pr.queued,
            "open_leases": rl.leases.open,
        }
    )
    return row


# -- all N -----------------------------------------------------------------------


def run_sim(
    replicas: Sequence[int] = (8, 32, 64),
    delay_s: float = 0.25,
    seconds: float = 10.0,
    warmup_s: float | None = None,
    reference: bool = True,
    procs: int = 2,
    profile_dir: Path | None = None,
) -> dict[str, Any]:
    """Run the simulation for each N in ``replicas`` (after N = 1 when ``reference``),
    each on a fresh controller, the rollout replicas spread over ``procs`` load
    processes. Returns ``{"sim": {...}}`` with one row per N. The load processes are
    spawned: a calling script must run this under ``if __name__ == "__main__":``."""
    cycle = delay_s * PROMPTS_PER_LEASE
    warm = warmup_s if warmup_s is not None else max(2.0, 3 * cycle)
    ns = ([1] if reference and 1 not in replicas else []) + list(replicas)
    rows = []
    with tempfile.TemporaryDirectory(prefix="phalanx-rl-sim-") as d:
        for n in ns:
            rows.append(bench_one(Path(d), n, delay_s, seconds, warm, procs, profile_dir))
    base = next((r["efficiency"] for r in rows if r["replicas"] == 1), None)
    for r in rows:
        r["efficiency_vs_n1"] = round(r["efficiency"] / base, 4) if base else None
    at = next((r for r in rows if r["replicas"] == TARGET_AT), None)
    return {
        "sim": {
            "delay_s": delay_s,
            "prompts_per_lease": PROMPTS_PER_LEASE,
            "group_size": GROUP_SIZE,
            "seconds": seconds,
            "warmup_s": warm,
            "target_efficiency": TARGET_EFFICIENCY,
            "target_replicas": TARGET_AT,
            "meets_target": None if at is None else at["efficiency"] >= TARGET_EFFICIENCY,
            "results": rows,
            "host": f"{platform.node()}: {os.cpu_count()} CPUs, python {platform.python_version()}",
        }
    }


def _table(sim: dict[str, Any]) -> None:
    cols = [
        ("replicas", "N"),
        ("ideal_per_s", "ideal/s"),
        ("rollouts_per_s", "got/s"),
        ("efficiency", "eff"),
        ("lease_p50_ms", "lease p50"),
        ("lease_p99_ms", "lease p99"),
        ("submit_p50_ms", "sub p50"),
        ("submit_p99_ms", "sub p99"),
        ("controller_cpu_percent", "ctl cpu%"),
        ("loadgen_cpu_percent", "gen cpu%"),
        ("others_cpu_percent", "other cpu%"),
        ("ledger_ok", "ledger"),
        ("lost", "lost"),
    ]
    print(" ".join(f"{h:>9}" for _, h in cols))
    for r in sim["results"]:
        print(" ".join(f"{'-' if r.get(k) is None else r[k]!s:>9}" for k, _ in cols))
    print("\noverhead per lease cycle (ms), beyond the simulated generation:")
    for r in sim["results"]:
        parts = ", ".join(f"{k} {v}" for k, v in r["overhead_ms_per_cycle"].items())
        print(f"  N={r['replicas']:>3}: {parts}")
    print(
        f"\ndelay {sim['delay_s']} s per rollout, {sim['prompts_per_lease']} prompts per lease, "
        f"{sim['seconds']} s measured after {sim['warmup_s']} s; target efficiency "
        f">= {sim['target_efficiency']} at N = {sim['target_replicas']}: "
        f"{'met' if sim['meets_target'] else 'not met' if sim['meets_target'] is False else '-'}"
    )
    print(sim["host"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--replicas", default="8,32,64", help="rollout replica counts (comma separated)")
    p.add_argument("--delay-s", type=float, default=0.25, help="simulated seconds per rollout")
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per N")
    p.add_argument("--warmup-s", type=float, help="seconds before measuring (default 3 cycles)")
    p.add_argument("--procs", type=int, default=2, help="load processes the replicas share")
    p.add_argument("--no-reference", action="store_true", help="skip the N = 1 reference")
    p.add_argument(
        "--profile-dir", type=Path, help="run each controller under cProfile, stats into this dir"
    )
    args = p.parse_args(argv)
    replicas = [int(x) for x in args.replicas.split(",")]
    if args.delay_s <= 0 or args.seconds <= 0 or min(replicas) < 1:
        p.error("--delay-s and --seconds must be > 0 and every --replicas count >= 1")
    out = run_sim(
        replicas,
        args.delay_s,
        args.seconds,
        args.warmup_s,
        not args.no_reference,
        args.procs,
        args.profile_dir,
    )
    if args.json:
        print(json.dumps(out), flush=True)
    else:
        _table(out["sim"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""RL benchmark (issue 4): GRPO on the sort task, phalanx next to the single-process
baseline, same model, same hyper-parameters, same machine, same run.

    python bench/rl.py [--json] [--repeats N] [--skip-chaos] [--skip-sim]
                       [--config examples/sort_grpo.toml] [--keep DIR]

Arms, run one after another (never side by side), each from a fresh process:

- ``single``: ``python -m phalanx.jobs.rl_single --config CONFIG --stop-at-exact-match T
  --window W`` (T, W: the job's ``rl.loop.target_exact_match`` and ``window``;
  the single-process loop reads the job file's ``[rl.*]`` sections): generation
  and training alternate in one process. The baseline.
- ``phalanx``: ``python -m phalanx.cli run CONFIG --plain --json``: a controller,
  1 policy replica and 2 rollout replicas (the job's ``n_init_replicas``).
- ``phalanx_chaos``: the same with ``--chaos kill-every=15`` (a random replica
  SIGKILLed every 15 s, restarted 2 s later).

With ``--repeats N`` each arm runs N times; repeat r runs the single arm with
``--grpo.seed r`` and the phalanx arms with ``--rl.grpo.seed r`` (the sampling
seed: completions are keyed by (seed, prompt index), whichever replica draws
them, so repeat r of every arm samples from the same stream) and ratios are
taken per repeat, then the median is reported.

Figures (the target: the trailing ``window``-batch mean exact match reaches T):

- ``seconds_to_exact_0_9`` (*from launch*): from the arm's ``Popen`` to the
  target, imports, model builds, controller start-up included, for all arms
  alike. single: arrival of the step line that reached the target; phalanx: the
  launcher's ``seconds_to_target`` (the controller's timestamp of the batch that
  reached it, from the launcher's start) plus the launcher's own start-up
  (``Popen`` to its start, which is the summary line's arrival minus ``wall_s``).
- ``seconds_to_exact_0_9_training_only``: from the first generation to the
  target. single: the summary's ``reached.exact_match_avg.seconds`` (clock
  started just before round 1's generation); phalanx: from the earliest
  ``t - gen_s`` of the rollout replicas' ``rollout`` lines.
- ``ratio_vs_single`` (from launch) and ``ratio_vs_single_training_only``, with
  the goals 1.5 (``phalanx``) and 2.0 (``phalanx_chaos``). ``batches`` (rounds
  of the single loop) and ``s_per_batch`` split a ratio into sample efficiency
  and throughput.
- ``weight_sync``: the policy leader's ``sync`` lines of the ``phalanx`` arm
  (``ms``: from the start of its send to the end of the broadcast, so it
  includes waiting for the rollout replicas to reach their next lease; they
  join between generation batches) as ``weight_sync_ms`` p50 / mean / max /
  count, and ``gloo_broadcast_gbps`` = bytes / p50 seconds / 1e9. Against
  ``loopback_broadcast_gbps``: a plain gloo broadcast of the same bytes among
  the same number of processes, measured after a barrier (``rl_workers.py``).
  **gbps here means GB/s, 1e9 bytes per second** (as in ``ft_ddp.py``).
- ``same_batch_rewards_as_single`` (per repeat): batches whose mean reward equals
  the single arm's. Sampling is keyed by (seed, prompt index) and every batch is
  generated with the weights of the step it starts at, so a phalanx run, chaos
  included, trains on the same rollouts as the single-process loop, batch for
  batch, unless float reduction order (batch shapes differ) flips a sample.
- ``sim``: control-plane scaling with simulated generation, ``rl_sim.run_sim``
  for 8, 32 and 64 rollout replicas (goal: efficiency >= 0.9 at 64).
- ``loadavg_start`` / ``loadavg_end`` (and per arm): this is a shared, noisy
  2-core machine; figures move with other tenants' load.

Every child runs in its own session and is stopped by its process group.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "sort_grpo.toml"
CHAOS = "kill-every=15"
GOALS = {"phalanx": 1.5, "phalanx_chaos": 2.0}
ARM_TIMEOUT_S = 900.0
STOP_GRACE_S = 30.0
"""After SIGTERM, how long the launcher gets to stop its replicas and controller."""
DEFINITIONS = {
    "seconds_to_exact_0_9": "from launch: the arm's Popen to the target (the first batch "
    "whose trailing window-batch mean exact match reaches it); imports and start-up included",
    "seconds_to_exact_0_9_training_only": "from the first generation to the target",
    "startup_s": "from launch to the first generation",
    "ratio_vs_single": "seconds_to_exact_0_9 (from launch) over single's, median over repeats",
    "ratio_vs_single_training_only": "seconds_to_exact_0_9_training_only over single's",
    "gbps": "GB/s: 1e9 bytes per second",
}
CHILD_ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
for _k in ("PHALANX_TOKEN", "PHALANX_CONTROLLER"):
    CHILD_ENV.pop(_k, None)


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def launch(cmd: list[str], err: Path, timeout_s: float) -> dict[str, Any]:
    """Run ``cmd`` in its own session; collect its stdout lines with their arrival
    times (also written beside ``err`` as ``.out``). On timeout: SIGTERM to its
    group, SIGKILL after ``STOP_GRACE_S``."""
    lines: list[tuple[float, str]] = []
    with err.open("wb") as f:
        t0 = time.time()
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=f,
            stdin=subprocess.DEVNULL,
            env=CHILD_ENV,
            cwd=ROOT,
            start_new_session=True,
        )

    def read() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            lines.append((time.time(), raw.decode(errors="replace").rstrip("\n")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        for sig, grace in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)
                break
    reader.join(timeout=10)
    err.with_suffix(".out").write_text("".join(line + "\n" for _, line in lines))
    return {"t0": t0, "rc": proc.returncode, "timed_out": timed_out, "lines": lines, "err": err}


def json_lines(lines: list[tuple[float, str]]) -> list[tuple[float, dict[str, Any]]]:
    out = []
    for t, line in lines:
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                out.append((t, json.loads(line)))
    return out


def failure(run: dict[str, Any], what: str) -> dict[str, Any]:
    tail = run["err"].read_text(errors="replace")[-1500:] if run["err"].exists() else ""
    why = "timed out" if run["timed_out"] else f"exit code {run['rc']}"
    return {"reached": False, "error": f"{what} ({why}); stderr tail: {tail}"}


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


# -- arms ------------------------------------------------------------------------


def arm_single(tmp: Path, config: Path, rl: dict[str, Any], seed: int, timeout_s: float):
    loop = rl.get("loop", {})
    cmd = [sys.executable, "-m", "phalanx.jobs.rl_single", "--config", str(config)]
    cmd += ["--stop-at-exact-match", str(loop.get("target_exact_match", 0.9))]
    cmd += ["--window", str(loop.get("window", 10)), "--grpo.seed", str(seed)]
    run = launch(cmd, tmp / f"single-{seed}.err", timeout_s)
    events = json_lines(run["lines"])
    summary = next((e for _, e in events if e.get("event") == "summary"), None)
    if summary is None:
        return failure(run, "single-process run printed no summary")
    # The target as the summary's reached.exact_match_avg defines it (a full window),
    # found here so that a config's other target counts too (the summary's is 0.9).
    target, window = loop.get("target_exact_match", 0.9), loop.get("window", 10)
    hit = next(
        (
            (t, e)
            for t, e in events
            if "exact_match_avg" in e and e["step"] >= window and e["exact_match_avg"] >= target
        ),
        None,
    )
    start = next(t for t, e in events if e.get("event") == "start")
    out: dict[str, Any] = {
        "reached": hit is not None,
        "seed": seed,
        "batch_rewards": [e["reward"] for _, e in events if "exact_match_avg" in e],
        "batches_run": summary["steps"],
        "startup_s": _r(start - run["t0"]),
        "wall_s": _r(run["lines"][-1][0] - run["t0"]),
    }
    if hit is not None:
        at, rec = hit
        out |= {
            "seconds_to_exact_0_9": _r(at - run["t0"]),
            "seconds_to_exact_0_9_training_only": _r(rec["seconds"]),
            "batches": rec["step"],
            "s_per_batch": _r(rec["seconds"] / rec["step"], 4),
        }
    return out


def read_log(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def arm_phalanx(
    tmp: Path, config: Path, label: str, chaos: str | None, seed: int, timeout_s: float
):
    run_dir = tmp / label
    cmd = [sys.executable, "-m", "phalanx.cli", "run", str(config), "--plain", "--json"]
    cmd += ["--rl.grpo.seed", str(seed)]
    cmd += ["--run-dir", str(run_dir)] + (["--chaos", chaos] if chaos else [])
    run = launch(cmd, tmp / f"{label}.err", timeout_s)
    found = [(t, e) for t, e in json_lines(run["lines"]) if e.get("event") == "summary"]
    if not found:
        return failure(run, "phalanx run printed no JSON summary")
    arrived, s = found[-1]
    started = arrived - s["wall_s"]  # the launcher's job.started_wall
    gens = [
        e["t"] - e["gen_s"]
        for p in sorted(run_dir.glob("rollout-*.log"))
        for e in read_log(p)
        if e.get("event") == "rollout"
    ]
    out: dict[str, Any] = {
        "reached": bool(s["reached"]),
        "ok": s["ok"],
        "error": s["error"],
        "batches_run": s["batches"],
        "startup_s": _r(min(gens) - run["t0"]) if gens else None,
        "wall_s": _r(arrived - run["t0"]),
        "launcher_startup_s": _r(started - run["t0"]),
        **{k: s[k] for k in ("kills", "restarts", "heals", "discarded", "ledger_ok", "syncs")},
        "run_dir": str(run_dir),
    }
    if s["reached"]:
        target = started + s["seconds_to_target"]
        train = target - min(gens) if gens else None
        out |= {
            "seconds_to_exact_0_9": _r(target - run["t0"]),
            "seconds_to_exact_0_9_training_only": _r(train),
            "batches": s["target_batch"] + 1,
            "s_per_batch": _r(train / (s["target_batch"] + 1), 4) if train else None,
        }
    out["sync_events"] = sync_events(run_dir)
    out["batch_rewards"] = batch_rewards(run_dir)
    return out


def batch_rewards(run_dir: Path) -> list[float]:
    """Each trained batch's mean reward, from the policy replicas' ``step`` lines
    (every commit of a batch reports it; a batch retried after a kill, too)."""
    by_batch: dict[int, float] = {}
    for p in sorted(run_dir.glob("policy-*.log")):
        for e in read_log(p):
            if e.get("event") == "step":
                by_batch.setdefault(e["batch"], e["reward"])
    return [by_batch[b] for b in sorted(by_batch)]


def same_rewards(run: dict[str, Any], base: dict[str, Any]) -> str | None:
    """Batches whose mean reward equals the single arm's (to the logs' 4 decimals,
    give or take one unit of rounding), out of the batches both ran."""
    a, b = run.get("batch_rewards"), base.get("batch_rewards")
    if not a or not b:
        return None
    n = min(len(a), len(b))
    return f"{sum(abs(x - y) < 2e-4 for x, y in zip(a[:n], b[:n], strict=True))}/{n}"


def sync_events(run_dir: Path) -> dict[str, list[Any]]:
    """The ``sync`` lines: the policy leader's (one per sync) and the receivers'."""
    pol = [e for p in run_dir.glob("policy-*.log") for e in read_log(p) if e.get("event") == "sync"]
    rol = [
        e for p in run_dir.glob("rollout-*.log") for e in read_log(p) if e.get("event") == "sync"
    ]
    return {
        "ms": [e["ms"] for e in pol if e.get("ok")],
        "bytes": [e["bytes"] for e in pol if e.get("ok")],
        "members": [e["members"] for e in pol if e.get("ok")],
        "failed": [e.get("error", "") for e in pol if not e.get("ok")],
        "rollout_ms": [e["ms"] for e in rol if e.get("ok")],
    }


# -- aggregation -----------------------------------------------------------------


def med(xs: list[Any]) -> float | None:
    xs = [x for x in xs if x is not None]
    return _r(statistics.median(xs), 4) if xs else None


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def ratio(a: dict[str, Any], b: dict[str, Any], key: str) -> float | None:
    x, y = a.get(key), b.get(key)
    return round(x / y, 3) if x and y else None


def summarize(runs: list[dict[str, Any]], base: list[dict[str, Any]] | None, goal: float | None):
    keys = ("seconds_to_exact_0_9", "seconds_to_exact_0_9_training_only", "batches")
    out: dict[str, Any] = {k: med([r.get(k) for r in runs]) for k in (*keys, "s_per_batch")}
    out |= {"startup_s": med([r.get("startup_s") for r in runs])}
    out["reached"] = f"{sum(bool(r.get('reached')) for r in runs)}/{len(runs)}"
    if base is not None:
        per = list(zip(runs, base, strict=True))
        out["ratio_vs_single"] = med([ratio(r, b, keys[0]) for r, b in per])
        out["ratio_vs_single_training_only"] = med([ratio(r, b, keys[1]) for r, b in per])
        out["batches_ratio_vs_single"] = med([ratio(r, b, "batches") for r, b in per])
        out["s_per_batch_ratio_vs_single"] = med([ratio(r, b, "s_per_batch") for r, b in per])
        out["same_batch_rewards_as_single"] = [same_rewards(r, b) for r, b in per]
        out["goal"] = goal
        rs = out["ratio_vs_single"]
        out["meets_goal"] = None if rs is None else rs <= goal
    drop = ("sync_events", "batch_rewards")
    out["runs"] = [{k: v for k, v in r.items() if k not in drop} for r in runs]
    return out


def weight_sync(runs: list[dict[str, Any]], loopback: dict[str, Any] | None) -> dict[str, Any]:
    keys = ("ms", "bytes", "members", "failed", "rollout_ms")
    ev = {k: [x for r in runs for x in r.get("sync_events", {}).get(k, [])] for k in keys}
    if not ev["ms"]:
        return {"count": 0, "reason": "no successful policy sync lines in the phalanx arm"}
    nbytes = statistics.median(ev["bytes"])
    p50 = pct(ev["ms"], 50)
    out = {
        "arm": "phalanx",
        "bytes": int(nbytes),
        "members": int(statistics.median(ev["members"])),
        "weight_sync_ms": {
            "p50": round(p50, 3),
            "mean": round(statistics.fmean(ev["ms"]), 3),
            "max": round(max(ev["ms"]), 3),
            "min": round(min(ev["ms"]), 3),
            "count": len(ev["ms"]),
            "failed": len(ev["failed"]),
        },
        "rollout_side_ms_p50": round(pct(ev["rollout_ms"], 50), 3) if ev["rollout_ms"] else None,
        "gloo_broadcast_gbps": round(nbytes / (p50 / 1e3) / 1e9, 4),
        "gbps_unit": "GB/s = 1e9 bytes per second (not Gbit/s)",
    }
    if loopback is not None:
        out["loopback"] = loopback
        out["loopback_broadcast_gbps"] = loopback["loopback_broadcast_gbps"]
        out["ratio_vs_loopback"] = round(
            out["gloo_broadcast_gbps"] / loopback["loopback_broadcast_gbps"], 3
        )
    return out


# -- output ----------------------------------------------------------------------


def table(res: dict[str, Any]) -> None:
    cols = [
        ("seconds_to_exact_0_9", "launch s"),
        ("seconds_to_exact_0_9_training_only", "train s"),
        ("batches", "batches"),
        ("s_per_batch", "s/batch"),
        ("startup_s", "start s"),
        ("ratio_vs_single", "ratio"),
        ("ratio_vs_single_training_only", "ratio tr"),
        ("goal", "goal"),
        ("reached", "reached"),
    ]
    print(f"{'arm':>14} " + " ".join(f"{h:>9}" for _, h in cols))
    for name, a in res["arms"].items():
        cells = " ".join(f"{'-' if a.get(k) is None else a[k]!s:>9}" for k, _ in cols)
        print(f"{name:>14} {cells}")
    print(
        "launch s: Popen to target (imports included); train s: first generation to target; "
        "start s: launch to first generation; ratio: launch s over single's, ratio tr: train s "
        "over single's (medians over repeats)"
    )
    for name, a in res["arms"].items():
        if a.get("same_batch_rewards_as_single"):
            print(
                f"{name}: batches with the single arm's mean reward, per repeat: "
                f"{', '.join(str(x) for x in a['same_batch_rewards_as_single'])}"
            )
    ws = res.get("weight_sync")
    if ws and ws.get("count", 1):
        m = ws["weight_sync_ms"]
        print(
            f"\nweight sync ({ws['bytes']} bytes to {ws['members'] - 1} rollout replicas): "
            f"p50 {m['p50']} ms, mean {m['mean']}, max {m['max']}, n {m['count']} "
            f"({m['failed']} failed) -> {ws['gloo_broadcast_gbps']} GB/s; loopback gloo "
            f"broadcast {ws.get('loopback_broadcast_gbps', '-')} GB/s, "
            f"ratio {ws.get('ratio_vs_loopback', '-')}"
        )
    sim = (res.get("sim") or {}).get("sim")
    if sim:
        print("\ncontrol plane (simulated generation):")
        for r in sim["results"]:
            print(
                f"  N={r['replicas']:>3}: efficiency {r['efficiency']}, lease p50/p99 "
                f"{r['lease_p50_ms']}/{r['lease_p99_ms']} ms, controller cpu "
                f"{r['controller_cpu_percent']}%, others' cpu {r['others_cpu_percent']}%"
            )
        print(f"  goal >= {sim['target_efficiency']} at N = 64: {sim['meets_target']}")
    print(f"\nload average {res['loadavg_start']} -> {res['loadavg_end']}; {res['host']}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="end with one JSON object")
    p.add_argument("--config", type=Path, default=CONFIG, help="the RL job TOML (all arms)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each arm")
    p.add_argument("--skip-chaos", action="store_true", help="skip the --chaos arm")
    p.add_argument("--skip-sim", action="store_true", help="skip the control-plane simulation")
    p.add_argument("--arm-timeout-s", type=float, default=ARM_TIMEOUT_S, help="per arm run")
    p.add_argument("--keep", type=Path, help="keep run dirs and logs here (default: a temp dir)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1: got {args.repeats}")
    config = args.config.resolve()
    rl = tomllib.loads(config.read_text()).get("rl", {})
    res: dict[str, Any] = {
        "bench": "rl",
        "config": str(config),
        "target_exact_match": rl.get("loop", {}).get("target_exact_match", 0.9),
        "window": rl.get("loop", {}).get("window", 10),
        "repeats": args.repeats,
        "chaos": None if args.skip_chaos else CHAOS,
        "loadavg_start": loadavg(),
        "definitions": DEFINITIONS,
    }
    runs: dict[str, list[dict[str, Any]]] = {"single": [], "phalanx": []}
    if not args.skip_chaos:
        runs["phalanx_chaos"] = []
    with contextlib.ExitStack() as stack:
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            tmp = args.keep
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="phalanx-rl-")))
        for i in range(args.repeats):
            d = tmp / f"r{i}"
            d.mkdir(exist_ok=True)
            for arm in runs:
                la = loadavg()[0]
                print(f"[bench/rl] repeat {i}: {arm} (load {la})", file=sys.stderr, flush=True)
                if arm == "single":
                    r = arm_single(d, config, rl, i, args.arm_timeout_s)
                else:
                    chaos = CHAOS if arm == "phalanx_chaos" else None
                    r = arm_phalanx(d, config, arm, chaos, i, args.arm_timeout_s)
                runs[arm].append(r | {"loadavg_1m_start": la, "loadavg_1m_end": loadavg()[0]})
        loopback = None
        members_bytes = [r["sync_events"]["bytes"] for r in runs["phalanx"] if "sync_events" in r]
        nbytes = [b for bs in members_bytes for b in bs]
        if nbytes:
            from rl_workers import run_loopback

            members = max(x for r in runs["phalanx"] for x in r["sync_events"]["members"])
            print("[bench/rl] loopback gloo broadcast", file=sys.stderr, flush=True)
            loopback = run_loopback(int(statistics.median(nbytes)), members)
    res["arms"] = {
        arm: summarize(rs, None if arm == "single" else runs["single"], GOALS.get(arm))
        for arm, rs in runs.items()
    }
    res["weight_sync"] = weight_sync(runs["phalanx"], loopback)
    if not args.skip_sim:
        from rl_sim import run_sim

        print("[bench/rl] control-plane simulation", file=sys.stderr, flush=True)
        res["sim"] = run_sim(replicas=(8, 32, 64))
    res["loadavg_end"] = loadavg()
    res["host"] = f"{platform.node()}: {os.cpu_count()} CPUs, python {platform.python_version()}"
    table(res)
    if args.json:
        print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

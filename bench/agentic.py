"""Agentic RL benchmark (issue 38): multi-turn episodes of the built-in coding
environment, their throughput, what a sandboxed tool call costs, and the turns lost
to SIGKILLs and to weight updates, in one run.

    python bench/agentic.py [--json] [--quick] [--batches N] [--kills N]
                            [--report-rounds N] [--sandbox-n N] [--keep DIR]

Every job is ``examples/agentic_code.toml`` (the built-in coding environment,
``phalanx.rl.agentic.code_env``: up to 3 turns, tool calls and unit tests in the
bubblewrap sandbox; HF engine; 4 prompts x 4 samples per batch, 2 prompts per lease,
64 tokens per turn, ``sync_every = 1``) on the ~1.1M-parameter Qwen2 of
``examples/make_model.py --agentic`` (random weights: the reward stays near 0; the
bench measures the pipeline, not learning), run from real processes by
``agentic_jobs.py``: a controller, 1 policy replica, N rollout replicas. Arms, one
after another (never side by side):

- ``one`` and ``two``: 1 and 2 rollout replicas, ``--batches`` batches (full 6,
  quick 2), unpaced.
- ``reports_on_<i>`` / ``reports_off_<i>``: ``one`` with ``REPORT_BATCHES`` batches,
  with and without the per-turn progress reports (``rl.env.report_turns``),
  alternated ``--report-rounds`` times (full 2, quick 0: off), so that the other
  tenants' load falls on both alike.
- ``updates``: 2 rollout replicas, each chunk of 16 tokens paced by
  ``rl.loop.chunk_delay_s`` (``PACE_S``), so weight updates find replicas generating.
- ``kills``: 2 rollout replicas, paced, one rollout per lease
  (``rl.loop.prompts_per_lease = 1``: each ``rollout`` line's ``replayed_turns`` is one
  rollout's), no end to the steps; the rollout replicas, in turn, are SIGKILLed
  mid-episode (their log's last line is a ``turn``: the lease has completed turns,
  more are in flight) ``--kills`` times (full 6, quick 2), every ``KILL_EVERY_S``, and
  started again 1 s later; the run ends when every rollout a killed process left
  was submitted by someone.

Figures (``--json``: one object with these keys, then each arm's details):

- ``turns_per_s_1`` / ``turns_per_s_2``: the rollout replicas' ``turn`` lines (turns
  generated, none replayed) over the generation wall time, from the earliest start
  of a lease's generation to the last lease's submission (``agentic_count.throughput``);
  ``turns_scaling``: their quotient. **This machine has 2 cores** (shared, with the
  policy replica and the controller beside the rollout replicas, each replica
  limited to 1 torch thread): 2 replicas do not make 2x.
- ``report_cost``: the median over rounds of 1 - ``turns_per_s`` with reports over
  ``turns_per_s`` without: the share of throughput the per-turn progress reports
  take (each a ``POST /v1/rl/episodes`` of the prompt's episodes so far, made in the
  episodes' event loop, so the next batch of turns waits for it); the rounds' pairs
  as ``report_pairs``.
- ``sandbox_p50_ms`` / ``sandbox_p99_ms``, ``plain_p50_ms`` / ``plain_p99_ms``,
  ``sandbox_overhead_ms`` (p50 difference), ``sandbox_ratio``: one tool call
  (``print(sum(range(1000)))``) in the bubblewrap sandbox against a plain subprocess,
  ``--sandbox-n`` calls each, interleaved (``agentic_sandbox.py``).
- ``lost_turns_per_kill`` (goal <= 1): turns a killed process completed (its ``turn``
  lines) that neither went into a rollout it submitted nor were replayed by the
  rollout's next holder, over the kills (``agentic_count.lost_turns``, which defines
  each term). ``inflight_episodes_per_kill``: episodes a kill interrupted (the next
  holder generated more turns for them), each losing the turn it had in flight, which
  the design allows. ``kills``; ``turns_carried`` (replayed, not regenerated) against
  the controller's ``rl.episodes.turns_carried``.
- ``aborted_turns_per_update`` (goal 0): turns abandoned over the weight updates that
  landed during generation (``inflight_updates``) in the ``updates`` arm
  (``agentic_count.aborted``).
- ``loadavg_start`` / ``loadavg_end`` and per arm: a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from agentic_count import Proc, aborted, lost_turns, throughput
from agentic_jobs import Chaos, Job
from agentic_sandbox import sandbox_overhead

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples" / "agentic_code.toml"
GROUP_SIZE = 4
"""The job file's ``rl.grpo.group_size`` (episodes per rollout)."""
PACE_S = 0.1
"""``rl.loop.chunk_delay_s`` of the paced arms: 0.1 s at each 16-token chunk."""
KILL_EVERY_S = 8.0
SETTINGS = {"full": {"batches": 6, "kills": 6, "sandbox_n": 200, "report_rounds": 2}}
SETTINGS["quick"] = {"batches": 2, "kills": 2, "sandbox_n": 30, "report_rounds": 0}
REPORT_BATCHES = 3
GOALS = {"lost_turns_per_kill": "<= 1", "aborted_turns_per_update": "0"}
ARM_TIMEOUT_S = 600.0


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def make_model(out: Path) -> Path:
    if not (out / "config.json").exists():
        cmd = [sys.executable, str(ROOT / "examples" / "make_model.py"), str(out), "--agentic"]
        subprocess.run(cmd, check=True, capture_output=True, cwd=ROOT)
    return out


def run_arm(
    name: str, tmp: Path, model: Path, rollouts: int, extra: list[str], chaos: Chaos | None
) -> Job:
    overrides = [
        f"--job.id=agentic-bench-{name}-{os.getpid()}",
        f"--rl.model.path={model}",
        f"--rl.task.tokenizer_path={model}",
        f"--roles.rollout.n_init_replicas={rollouts}",
        # 1: a killed replica's peer goes on leasing (min_replicas holds leases back).
        "--roles.rollout.min_replicas=1",
        "--rl.loop.target_reward=null",
        "--rl.loop.target_exact_match=null",
        *extra,
    ]
    print(f"[bench/agentic] {name} (load {loadavg()[0]})", file=sys.stderr, flush=True)
    job = Job(tmp / name, CONFIG, overrides, rollouts, chaos, ARM_TIMEOUT_S)
    return job.run()


def procs_of(job: Job) -> list[Proc]:
    return [Proc(p.label, p.events(), p.killed_at) for p in job.rollout_procs()]


def arm_record(name: str, job: Job, figures: dict[str, Any], t: float) -> dict[str, Any]:
    ep = (job.status.get("rl") or {}).get("episodes") or {}
    out = {"arm": name, **figures, "wall_s": round(time.time() - t, 1)}
    out |= {"controller_episodes": ep, "loadavg_end": loadavg()}
    return out | ({"error": job.error} if job.error else {})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--json", action="store_true", help="one JSON object, then one per arm")
    p.add_argument("--quick", action="store_true", help="a short run: figures are no measure")
    p.add_argument("--batches", type=int, help="batches of the throughput arms")
    p.add_argument("--kills", type=int, help="SIGKILLs of the kills arm")
    p.add_argument("--sandbox-n", type=int, help="tool calls per sandbox arm")
    p.add_argument("--report-rounds", type=int, help="pairs of arms with and without reports")
    p.add_argument("--keep", type=Path, help="keep run dirs and logs here (default: a temp dir)")
    a = p.parse_args(argv)
    s = dict(SETTINGS["quick" if a.quick else "full"])
    for k in ("batches", "kills", "sandbox_n", "report_rounds"):
        if getattr(a, k) is not None:
            least = 0 if k == "report_rounds" else 1
            if getattr(a, k) < least:
                p.error(f"--{k.replace('_', '-')} must be >= {least}: got {getattr(a, k)}")
            s[k] = getattr(a, k)
    for k in ("PHALANX_TOKEN", "PHALANX_CONTROLLER"):
        os.environ.pop(k, None)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out: dict[str, Any] = {"quick": a.quick, "loadavg_start": loadavg(), **s}
    arms: list[dict[str, Any]] = []
    paced = [f"--rl.loop.chunk_delay_s={PACE_S}"]
    with contextlib.ExitStack() as stack:
        if a.keep:
            tmp = a.keep
            tmp.mkdir(parents=True, exist_ok=True)
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="phalanx-agentic-")))
        model = make_model(tmp / "model")
        t = time.time()
        out |= sandbox_overhead(s["sandbox_n"])
        arms.append({"arm": "sandbox", "wall_s": round(time.time() - t, 1)})
        steps = [f"--rl.grpo.steps={s['batches']}"]
        tps: dict[str, float | None] = {}
        for name, n in (("one", 1), ("two", 2)):
            t = time.time()
            job = run_arm(name, tmp, model, n, steps, None)
            arms.append(arm_record(name, job, throughput(procs_of(job)), t))
            tps[name] = arms[-1].get("turns_per_s")
        r1, r2 = tps["one"], tps["two"]
        out |= {"turns_per_s_1": r1, "turns_per_s_2": r2}
        out["turns_scaling"] = round(r2 / r1, 3) if r1 and r2 else None
        pairs = []
        for i in range(s["report_rounds"]):
            pair = []
            for on in (True, False):
                name, t = f"reports_{'on' if on else 'off'}_{i}", time.time()
                extra = [
                    f"--rl.grpo.steps={REPORT_BATCHES}",
                    f"--rl.env.report_turns={str(on).lower()}",
                ]
                job = run_arm(name, tmp, model, 1, extra, None)
                arms.append(arm_record(name, job, throughput(procs_of(job)), t))
                pair.append(arms[-1].get("turns_per_s"))
            pairs.append(pair)
        costs = [1 - on / off for on, off in pairs if on and off]
        out["report_pairs"] = pairs
        out["report_cost"] = round(statistics.median(costs), 3) if costs else None
        t = time.time()
        job = run_arm("updates", tmp, model, 2, [*steps, *paced], None)
        arms.append(arm_record("updates", job, aborted(procs_of(job), GROUP_SIZE), t))
        out["aborted_turns_per_update"] = arms[-1]["aborted_turns_per_update"]
        out["inflight_updates"] = arms[-1]["inflight_updates"]
        t = time.time()
        chaos = Chaos(KILL_EVERY_S, s["kills"], after_turns=(1, GROUP_SIZE + 1))
        kill_extra = ["--rl.grpo.steps=100000", "--rl.loop.prompts_per_lease=1", *paced]
        job = run_arm("kills", tmp, model, 2, kill_extra, chaos)
        lost = lost_turns(procs_of(job)) | {
            "aborted": aborted(procs_of(job), GROUP_SIZE)["aborted_turns"]
        }
        arms.append(arm_record("kills", job, lost, t))
        for k in ("lost_turns_per_kill", "inflight_episodes_per_kill", "kills"):
            out[k] = lost[k]
        out["turns_carried"] = lost["turns_carried"]
        out["controller_turns_carried"] = arms[-1]["controller_episodes"].get("turns_carried")
    out |= {"goals": GOALS, "loadavg_end": loadavg()}
    out["host"] = f"{platform.node()}: {os.cpu_count()} CPUs, python {platform.python_version()}"
    out["errors"] = [f"{r['arm']}: {r['error']}" for r in arms if "error" in r]
    if a.json:
        print(json.dumps(out))
        for r in arms:
            print(json.dumps(r))
    else:
        for k, v in out.items():
            print(f"{k:>28}: {v}")
        for r in arms:
            print(json.dumps(r))
    return 1 if out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())

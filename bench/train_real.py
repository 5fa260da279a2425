"""Your model, your data: phalanx's training half on a real workload, every figure
against a baseline measured in the same run (issue 41).

    python bench/train_real.py [--json] [--quick] [--rounds 2] [--steps 6]
                               [--no-torchft] [--no-hsdp] [--no-goodput] [--no-diloco]
                               [--no-streaming]

The workload is ``examples/pretrain_code.toml``'s: the ~20M Qwen2 of
``examples/make_model.py`` (models/qwen2-20m) pretraining on the Python standard
library's source (``examples/make_corpus.py``, data/stdlib), packed into
``--seq-len`` tokens, AdamW (lr 1e-3, weight decay 0.1), float32, one torch thread
per process, glibc told to keep freed memory (as a replica does) in every arm.
Timeouts: collective 10 s, heartbeat 20 s, join 1 s (the example's), the same for
torchft. Each arm's data, loss and micro-batches come from the same code
(:func:`phalanx.jobs.task.build`); they differ only in how they are distributed.

Figures (every ratio is taken per round, between arms run back to back in the
same invocation, in an order that alternates between rounds; the median over the
rounds is reported):

- ``ddp_step_ratio``: phalanx FT-DDP's median step (gaps between commits after
  ``--warmup`` steps; a real controller and ``--replicas`` ``phalanx replica``
  processes, ``bench/ft_ddp.py``'s arm) over plain
  ``torch.nn.parallel.DistributedDataParallel`` on as many ranks over a static gloo
  group, with the same global batch and micro-batches (``no_sync`` but for the last).
  Goal <= 1.05.
- ``torchft_step_ratio``: the same phalanx step over torchft 0.2's (``Manager``,
  ``DistributedDataParallel``, ``OptimizerWrapper`` over ``ProcessGroupGloo``, a
  lighthouse; ``bench/ft_ddp_workers.py``'s, with its one fix). Goal <= 0.85.
- ``hsdp_step_ratio``: HSDP (2 replicas of 2 ranks, ``[replica] ranks = 2``) over
  plain FSDP2 on the same 4 ranks (``bench/hsdp.py``'s arms). Goal <= 1.05.
- ``heal_ratio``: a joiner's heal bandwidth (``Manager.last_heal``: the state's bytes
  over its transfer, from the first byte to the last) over a plain gloo broadcast of
  as many bytes between 2 fresh processes (median of 15). ``ft_ddp``: in the last
  round one replica is SIGKILLed and started again (``bench/ft_ddp.py``'s kill cycle;
  it also gives ``stall_s`` and ``join_s``); ``hsdp``: the whole replica (both
  shards at once) after its rank 1 is SIGKILLed, each round (``bench/hsdp.py``).
  Goal >= 0.7. ``heal_ratio_chaos``: the heals of the goodput run, for reference.
- ``goodput``: ``phalanx run`` of the FT-DDP job, ``--goodput-steps`` steps, calm and
  then under ``--chaos kill-every=--kill-every`` (a random replica SIGKILLed on
  that period, restarted ``restart-after`` later, as the launcher does): committed
  tokens over the chaos run's wall time (first commit to last) over the calm run's
  tokens per second. The issue's period is 60 s; on this VM's slower steps the
  default is scaled down to 30 s. Goal >= 0.95.
- ``diloco_val_loss_ratio``: sync DiLoCo (H = ``--diloco-h``, outer Nesterov SGD lr
  0.7, momentum 0.9) over DDP (phalanx's FT-DDP job: the same gradient as DDP), the
  validation loss of each final model on the first ``--val-samples`` validation
  sequences, at equal tokens: ``--diloco-replicas`` replicas, ``--diloco-steps``
  (inner) steps of ``--diloco-batch`` sequences each, the same samples in the same
  order. Both start from one warm start (``--diloco-warmup`` steps of the model in
  one process, on other samples), as DiLoCo starts from a pretrained model.
  Goal <= 1.03.
- ``streaming_overlap``: the share of Streaming DiLoCo's exchange time that the
  inner steps hide in the sync job (``train_real_runs.streaming_arm``: τ = 0 against
  τ = H / 2 - 1, the replicas' ``exchange_wait_s``). Goal >= 0.8.
- per arm ``tokens_per_s`` (global batch x sequence length / median step),
  ``peak_mem_mb`` (the largest peak resident set of its processes: the step
  lines' ``peak_mem_mb``, or ``VmHWM``) and ``mfu`` (null on a CPU, which has no
  agreed peak; ``tflops``: the 6 N FLOPs per token achieved, for comparison).

Every child runs in its own session and is killed by process group at the end;
every port comes from binding port 0.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import hsdp
from ft_ddp import (
    VICTIM,
    Child,
    Children,
    children,
    guarded,
    machine,
    measure_steady,
    run_phalanx,
    tcp_store,
    torchft_version,
)
from train_real_runs import (
    TIMEOUTS,
    TORCHFT_JOIN_TIMEOUT_S,
    diloco_arm,
    goodput_arm,
    job_toml,
    streaming_arm,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

WORKERS = str(HERE / "train_real_workers.py")
PY = sys.executable
GOALS = {
    "ddp_step_ratio": ("<=", 1.05),
    "torchft_step_ratio": ("<=", 0.85),
    "hsdp_step_ratio": ("<=", 1.05),
    "goodput": (">=", 0.95),
    "diloco_val_loss_ratio": ("<=", 1.03),
    "streaming_overlap": (">=", 0.8),
    "heal_ratio.ft_ddp": (">=", 0.7),
    "heal_ratio.hsdp": (">=", 0.7),
}


@dataclass(frozen=True)
class Settings:
    """One run's sizes (the defaults fit this 2-core VM: about 45 minutes in all)."""

    model: str = "models/qwen2-20m"
    data: str = "data/stdlib"
    cache_dir: str = "~/.cache/phalanx/data"
    seq_len: int = 128
    batch: int = 12
    """Global batch (sequences per committed step) of the step-time and goodput arms."""
    micro: int = 2
    """Micro-batch: 2 per replica per step at the defaults (accumulation exercised)."""
    replicas: int = 3
    steps: int = 6
    """Measured steps per arm and round, after ``warmup``."""
    warmup: int = 3
    rounds: int = 2
    hsdp_after: int = 10
    """HSDP: steps the job runs past the kill (room for the heal)."""
    goodput_steps: int = 50
    kill_every: float = 30.0
    restart_after: float = 2.0
    diloco_replicas: int = 2
    diloco_batch: int = 8
    diloco_micro: int = 2
    diloco_h: int = 50
    diloco_steps: int = 200
    diloco_variants: str = ""
    """More DiLoCo runs against the same DDP: ``LR:MOMENTUM:FRAGMENTS``, comma-separated."""
    streaming_h: int = 8
    """Streaming DiLoCo's H in the overlap arm (2 fragments, τ = H / 2 - 1)."""
    streaming_rounds: int = 3
    diloco_warmup: int = 100
    val_samples: int = 64
    threads: int = 2
    """Threads of the single-process helpers (warm start, validation)."""


QUICK = {
    "batch": 6,
    "steps": 3,
    "warmup": 2,
    "rounds": 1,
    "hsdp_after": 8,
    "goodput_steps": 15,
    "kill_every": 10.0,
    "diloco_h": 5,
    "diloco_steps": 10,
    "diloco_warmup": 2,
    "val_samples": 8,
    "streaming_h": 4,
    "streaming_rounds": 2,
}


# -- the FT-DDP arms ---------------------------------------------------------------


def _worker(ch: Children, kind: str, spec: dict[str, Any], label: str) -> Child:
    return ch.spawn([PY, WORKERS, kind, json.dumps(spec)], label)


def _peak(procs: list[Child]) -> float | None:
    peaks = [e["peak_mem_mb"] for p in procs for e in p.steps() if "peak_mem_mb" in e]
    return max(peaks) if peaks else None


def run_ddp(ch: Children, cfg: Path, s: Settings, tag: str) -> dict[str, Any]:
    with tcp_store() as store:
        procs = [
            _worker(
                ch,
                "ddp",
                {
                    "config": str(cfg),
                    "rank": r,
                    "world": s.replicas,
                    "store": store,
                    "prefix": tag,
                    "steps": s.warmup + s.steps + 1,
                },
                f"ddp{r}-{tag}",
            )
            for r in range(s.replicas)
        ]
        out = measure_steady(procs, s.steps, "DDP", [], s.warmup)
        for p in procs:
            p.proc.wait(timeout=60)
    out["peak_mem_mb"] = _peak(procs)
    return out


def run_torchft(ch: Children, cfg: Path, s: Settings, tag: str) -> dict[str, Any]:
    t = TIMEOUTS
    lh = ch.worker(
        "lighthouse",
        {"join_timeout_s": TORCHFT_JOIN_TIMEOUT_S, "heartbeat_s": t["heartbeat_s"]},
        f"lighthouse-{tag}",
    )
    addr = lh.wait(lambda: [e for e in lh.events if e.get("event") == "address"], "lighthouse")
    spec = {
        "config": str(cfg),
        "lighthouse": addr[0]["address"],
        "replicas": s.replicas,
        "collective_s": t["collective_s"],
        # Its RPCs and a heal's HTTP transfer of the whole state (~250 MB here).
        "timeout_s": t["heartbeat_s"],
    }
    procs = [
        _worker(ch, "torchft", {**spec, "index": i}, f"torchft{i}-{tag}") for i in range(s.replicas)
    ]
    out = measure_steady(procs, s.steps, "torchft", [lh], s.warmup)
    out["peak_mem_mb"] = _peak(procs)
    return out


def run_ours(ch: Children, tmp: Path, cfg: Path, s: Settings, tag: str, kill: bool):
    """phalanx FT-DDP (``bench/ft_ddp.py``'s arm on ``cfg``); with ``kill``, one
    SIGKILL/restart cycle after the steady window, and the joiner's heal record."""
    out = run_phalanx(
        ch, tmp, s.steps, int(kill), tag, cfg=cfg, replicas=s.replicas, warmup=s.warmup
    )
    procs = [c for c in ch.all if c.label.startswith("phalanx-r") and c.label.endswith(tag)]
    out["peak_mem_mb"] = _peak(procs)
    if kill:
        joiner = [c for c in procs if c.label == f"phalanx-r{VICTIM}-{tag}"][-1]
        heals = [e["heal"] for e in joiner.steps() if e.get("heal")]
        out["heal"] = heals[0] if heals else None
    return out


def ft_ddp_rounds(ch: Children, tmp: Path, s: Settings, use_torchft: bool) -> list[dict]:
    cfg = job_toml(tmp / "ft-ddp.toml", s, replicas=s.replicas, steps=10_000_000)
    rounds = []
    for r in range(s.rounds):
        last = r == s.rounds - 1
        arms: dict[str, Callable[[], dict[str, Any]]] = {
            "ddp": lambda r=r: run_ddp(ch, cfg, s, f"d{r}"),
            "phalanx": lambda r=r, k=last: run_ours(ch, tmp, cfg, s, f"p{r}", k),
        }
        if use_torchft:
            arms["torchft"] = lambda r=r: run_torchft(ch, cfg, s, f"t{r}")
        row: dict[str, Any] = {}
        # Alternate the order, so that a drift in the machine's load does not
        # always favour the same arm.
        for name in list(arms) if r % 2 == 0 else list(reversed(arms)):
            row[name] = guarded(arms[name], name)
            ch.stop()
        rounds.append(row)
    return rounds


# -- the HSDP arms -------------------------------------------------------------------


def hsdp_rounds(tmp: Path, s: Settings) -> list[dict]:
    measured = s.warmup + s.steps
    cfg = job_toml(tmp / "hsdp.toml", s, replicas=2, ranks=2, steps=measured + s.hsdp_after)
    rounds = []
    for r in range(s.rounds):
        arms: dict[str, Callable[[], dict[str, Any]]] = {
            "fsdp": lambda: hsdp.fsdp_arm(tmp, cfg, 4, measured, s.warmup),
            "hsdp": lambda: hsdp.hsdp_arm(tmp, cfg, measured, s.warmup),
        }
        row: dict[str, Any] = {}
        for name in list(arms) if r % 2 == 0 else list(reversed(arms)):
            row.update(_guarded_flat(arms[name], name))
        rounds.append(row)
    return rounds


def _guarded_flat(fn: Callable[[], dict[str, Any]], what: str) -> dict[str, Any]:
    try:
        return fn()
    except Exception as e:
        return {f"{what}_error": f"{what} failed: {e}"[:2000]}


# -- figures -------------------------------------------------------------------------


def _median(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return round(statistics.median(vals), 3) if vals else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def arm_figures(step_s: float | None, s: Settings, params: int, peak: float | None) -> dict:
    """An arm's throughput figures at its median step ``step_s``."""
    if step_s is None:
        return {"step_s": None}
    tps = s.batch * s.seq_len / step_s
    return {
        "step_s": round(step_s, 4),
        "tokens_per_s": round(tps, 1),
        "mfu": None,
        "tflops": round(6 * params * tps / 1e12, 5),
        "peak_mem_mb": peak,
    }


def ft_ddp_figures(rounds: list[dict], s: Settings, params: int) -> dict[str, Any]:
    def step(r: dict, arm: str) -> float | None:
        return r.get(arm, {}).get("median_step_s")

    out: dict[str, Any] = {
        "ddp_step_ratio": _median([_ratio(step(r, "phalanx"), step(r, "ddp")) for r in rounds]),
        "torchft_step_ratio": _median(
            [_ratio(step(r, "phalanx"), step(r, "torchft")) for r in rounds]
        ),
        "per_round": [
            {
                **{f"{a}_step_s": step(r, a) for a in ("ddp", "phalanx", "torchft")},
                "ddp_ratio": _ratio(step(r, "phalanx"), step(r, "ddp")),
                "torchft_ratio": _ratio(step(r, "phalanx"), step(r, "torchft")),
                **{
                    f"{a}_cpu_s_per_step": r[a].get("system_cpu_s_per_step")
                    for a in ("ddp", "phalanx", "torchft")
                    if a in r
                },
            }
            for r in rounds
        ],
    }
    arms = {}
    for a in ("ddp", "phalanx", "torchft"):
        steps = [step(r, a) for r in rounds]
        peaks = [r.get(a, {}).get("peak_mem_mb") for r in rounds]
        arms[a] = arm_figures(_median(steps), s, params, max(filter(None, peaks), default=None))
        errors = [r[a]["reason"] for r in rounds if r.get(a, {}).get("reason")]
        if errors:
            arms[a]["errors"] = errors
    out["arms"] = arms
    ph = rounds[-1].get("phalanx", {})
    for k in ("stall_s", "join_s", "join_minus_import_s"):
        out[k] = ph.get(k)
    out["heal"] = ph.get("heal")
    return out


def hsdp_figures(rounds: list[dict], s: Settings, params: int) -> dict[str, Any]:
    ratios = [_ratio(r.get("hsdp_step_s"), r.get("fsdp_step_s")) for r in rounds]
    keep = [
        *("fsdp_step_s", "hsdp_step_s", "stall_s", "heal_bytes", "heal_transfer_s"),
        *("heal_gbps", "heal_s", "heal_wait_s", "fsdp_peak_mem_mb", "hsdp_peak_mem_mb"),
        *("fsdp_error", "hsdp_error"),
    ]
    out: dict[str, Any] = {
        "hsdp_step_ratio": _median(ratios),
        "per_round": [
            {"ratio": x, **{k: _round(r[k]) for k in keep if k in r}}
            for x, r in zip(ratios, rounds, strict=True)
        ],
    }
    out["arms"] = {
        a: arm_figures(
            _median([r.get(f"{a}_step_s") for r in rounds]),
            s,
            params,
            max(filter(None, (r.get(f"{a}_peak_mem_mb") for r in rounds)), default=None),
        )
        for a in ("fsdp", "hsdp")
    }
    return out


def _round(v: Any) -> Any:
    return round(v, 4) if isinstance(v, float) else v


def heal_figures(tmp: Path, ft: dict[str, Any] | None, hs: list[dict] | None) -> dict[str, Any]:
    """Each heal's bandwidth over a gloo broadcast of as many bytes (median of 15)."""
    out: dict[str, Any] = {}
    heal = (ft or {}).get("heal")
    if heal:
        gbps = heal["bytes"] / heal["transfer_s"] / 1e9
        bc = hsdp.broadcast_gbps(tmp, heal["bytes"])
        out["ft_ddp"] = {
            "bytes": heal["bytes"],
            "transfer_s": round(heal["transfer_s"], 4),
            "wait_s": round(heal["wait_s"], 4),
            "warm": heal["warm"],
            "heal_gbps": round(gbps, 3),
            "gloo_broadcast_gbps": round(bc, 3),
            "ratio": round(gbps / bc, 3),
        }
    heals = [r for r in hs or [] if r.get("heal_gbps")]
    if heals:
        nbytes = heals[0]["heal_bytes"]
        bc = hsdp.broadcast_gbps(tmp, nbytes)
        gbps = [r["heal_gbps"] for r in heals]
        out["hsdp"] = {
            "bytes": nbytes,
            "heal_gbps": [round(g, 3) for g in gbps],
            "gloo_broadcast_gbps": round(bc, 3),
            "ratios": [round(g / bc, 3) for g in gbps],
            "ratio": round(statistics.median(gbps) / bc, 3),
        }
    return out


def goals(fig: dict[str, Any]) -> dict[str, bool | None]:
    out: dict[str, bool | None] = {}
    for key, (op, bound) in GOALS.items():
        v: Any = fig
        for part in key.split("."):
            v = v.get(part) if isinstance(v, dict) else None
        if isinstance(v, dict):
            v = v.get("ratio")
        out[f"{key} {op} {bound}"] = (
            None if v is None else (v <= bound if op == "<=" else v >= bound)
        )
    return out


# -- main ----------------------------------------------------------------------------


def prepare(ch: Children, tmp: Path, s: Settings) -> dict[str, Any]:
    """Check the model and corpus exist, and tokenize (once: cached) before any timing."""
    for p, how in ((s.model, "examples/make_model.py"), (s.data, "examples/make_corpus.py")):
        if not (ROOT / p).exists() and not Path(p).exists():
            raise SystemExit(f"train_real: {p} must exist: got none. Run python {how} first.")
    cfg = job_toml(tmp / "prepare.toml", s, replicas=1, steps=1)
    c = _worker(ch, "prepare", {"config": str(cfg)}, "prepare")
    return c.wait(
        lambda: next((e for e in c.events if e["event"] == "prepared"), None),
        "the data",
        timeout=1800,
    )


def run(s: Settings, args: argparse.Namespace, tmp: Path) -> list[dict[str, Any]]:
    t0 = time.time()
    lines: list[dict[str, Any]] = []
    info = machine()
    log = (lambda *_: None) if args.json else (lambda m: print(m, file=sys.stderr, flush=True))
    with children(tmp) as ch:
        prep = prepare(ch, tmp, s)
        ch.stop()
        params = prep["params"]
        log(f"prepared: {prep}")
        summary: dict[str, Any] = {"params": params}
        ft = hs = hs_rounds = None
        if not args.no_ft_ddp:
            tf = not args.no_torchft and torchft_version() is not None
            rounds = ft_ddp_rounds(ch, tmp, s, tf)
            ft = ft_ddp_figures(rounds, s, params)
            lines.append({"arm": "ft_ddp", **ft, "rounds_raw": rounds})
            summary.update({k: ft[k] for k in ("ddp_step_ratio", "torchft_step_ratio")})
            log(f"ft_ddp: {json.dumps(ft['per_round'])}")
        if not args.no_hsdp:
            hs_rounds = hsdp_rounds(tmp, s)
            hs = hsdp_figures(hs_rounds, s, params)
            lines.append({"arm": "hsdp", **hs})
            summary["hsdp_step_ratio"] = hs["hsdp_step_ratio"]
            log(f"hsdp: {json.dumps(hs['per_round'])}")
        heal = guarded(lambda: heal_figures(tmp, ft, hs_rounds), "heal")
        lines.append({"arm": "heal", **heal})
        summary["heal_ratio"] = {k: heal[k]["ratio"] for k in ("ft_ddp", "hsdp") if k in heal}
        if not args.no_goodput:
            gp = guarded(lambda: goodput_arm(ch, tmp, s, params), "goodput")
            lines.append({"arm": "goodput", **gp})
            summary["goodput"] = gp.get("goodput")
            chaos = [h["ratio"] for h in gp.get("heals", []) if h.get("ratio")]
            summary["heal_ratio_chaos"] = chaos
            ch.stop()
            log(f"goodput: {gp.get('goodput')}")
        if not args.no_diloco:
            dl = guarded(lambda: diloco_arm(ch, tmp, s), "diloco")
            lines.append({"arm": "diloco", **dl})
            summary["diloco_val_loss_ratio"] = dl.get("diloco_val_loss_ratio")
            if dl.get("variants"):
                summary["diloco_variants"] = dl["variants"]
            ch.stop()
        if not args.no_streaming:
            st = guarded(lambda: streaming_arm(ch, tmp, s), "streaming")
            lines.append({"arm": "streaming", **st})
            summary["streaming_overlap"] = st.get("streaming_overlap")
            log(f"streaming: {json.dumps(st)}")
            ch.stop()
        summary["arms"] = {
            **({k: v for k, v in ft["arms"].items()} if ft else {}),
            **({k: v for k, v in hs["arms"].items()} if hs else {}),
        }
        summary["mfu_note"] = "null on a CPU: phalanx.train.perf knows no CPU peak rate"
    summary["goals_met"] = goals(summary)
    summary["settings"] = asdict(s)
    summary["machine"] = {**info, "loadavg_end": _load()}
    summary["runtime_s"] = round(time.time() - t0, 1)
    lines.append({"summary": summary})
    return lines


def _load() -> list[float]:
    import os

    return [round(x, 2) for x in os.getloadavg()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    d = Settings()
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    p.add_argument("--quick", action="store_true", help="a smoke run: small sizes (minutes)")
    p.add_argument("--keep", type=Path, help="keep the children's logs in this (new) directory")
    for name in ("ft-ddp", "torchft", "hsdp", "goodput", "diloco", "streaming"):
        p.add_argument(f"--no-{name}", action="store_true", help=f"skip the {name} arm(s)")
    for f, v in asdict(d).items():
        p.add_argument(
            f"--{f.replace('_', '-')}", type=type(v), default=None, help=f"(default {v})"
        )
    args = p.parse_args(argv)
    s = replace(d, **QUICK) if args.quick else d
    s = replace(s, **{f: getattr(args, f) for f in asdict(d) if getattr(args, f) is not None})
    with contextlib.ExitStack() as stack:
        if args.keep:
            args.keep.mkdir(parents=True)
            tmp = args.keep.resolve()
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="train-real-")))
        lines = run(s, args, tmp)
    if args.json:
        for line in lines:
            print(json.dumps(line), flush=True)
    else:
        report(lines[-1]["summary"])
    return 0


def report(sm: dict[str, Any]) -> None:
    for k in (
        "ddp_step_ratio",
        "torchft_step_ratio",
        "hsdp_step_ratio",
        "heal_ratio",
        "heal_ratio_chaos",
        "goodput",
        "diloco_val_loss_ratio",
        "streaming_overlap",
    ):
        print(f"{k:>24}: {sm.get(k)}")
    print()
    for arm, f in sm.get("arms", {}).items():
        print(f"{arm:>10}: {f}")
    print("\ngoals:", ", ".join(f"{k}: {v}" for k, v in sm["goals_met"].items()))
    print(f"runtime {sm['runtime_s']} s, load at the end {sm['machine']['loadavg_end']}")


if __name__ == "__main__":
    sys.exit(main())

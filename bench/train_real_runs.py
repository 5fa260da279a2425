"""The job files of ``bench/train_real.py`` and its arms that run whole jobs under
``phalanx run`` (the product's launcher, with its zygote and its chaos): goodput,
calm against ``--chaos``, and DiLoCo's validation loss against DDP's.

A job's commit times come from its replicas' ``step`` lines in the run directory
(``policy-N.log``, every incarnation appended): step s is committed at the first
line that reports it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ft_ddp import Children
    from train_real import Settings

ROOT = Path(__file__).resolve().parents[1]
WORKERS = str(Path(__file__).resolve().with_name("train_real_workers.py"))
PY = sys.executable
TIMEOUTS = {"collective_s": 10.0, "heartbeat_s": 20.0, "join_timeout_s": 1.0}
"""``examples/pretrain_code.toml``'s, for phalanx and torchft alike (torchft's join
timeout aside: :data:`TORCHFT_JOIN_TIMEOUT_S`)."""
TORCHFT_JOIN_TIMEOUT_S = 30.0
"""torchft's lighthouse cuts a replica that asks for the quorum more than its join
timeout after the others; with 1 s, steps of seconds on a loaded 2-core machine cut
one replica nearly every step, which then heals (over HTTP) and is late again: the
arm never has its 3 replicas in. phalanx waits for a replica of the last quorum that
still heartbeats up to ``max(collective_s, collective_patience_s)`` (30 s at the
defaults, docs/architecture.md); torchft's lighthouse gets the same 30 s."""


def _abs(p: str) -> str:
    q = Path(p).expanduser()
    return str(q if q.is_absolute() else (ROOT / q).resolve())


def job_toml(
    path: Path,
    s: Settings,
    *,
    replicas: int,
    steps: int,
    ranks: int = 1,
    batch: int | None = None,
    micro: int | None = None,
    model: str | None = None,
    diloco_h: int | None = None,
    fragments: int = 1,
    tau: int = 0,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
) -> Path:
    """The benchmark's job file: ``s``'s model, data and sizes (or ``batch``,
    ``micro``, ``model`` instead), ``replicas`` replicas of ``ranks`` ranks,
    ``steps`` steps; with ``diloco_h``, sync DiLoCo at that H (Streaming DiLoCo with
    ``fragments`` and ``tau``), outer Nesterov SGD at ``outer_lr`` and
    ``outer_momentum``)."""
    t = TIMEOUTS
    data = Path(_abs(s.data))
    rep = f"[replica]\nranks = {ranks}\n" if ranks > 1 else ""
    dl = (
        f'[diloco]\nmode = "sync"\nsync_every = {diloco_h}\nfragments = {fragments}\ntau = {tau}\n'
        f"outer_lr = {outer_lr}\nouter_momentum = {outer_momentum}\n"
        if diloco_h
        else ""
    )
    path.write_text(
        f"""[job]
id = "bench-train-real"
seed = 0

[timeouts]
collective_s = {t["collective_s"]}
heartbeat_s = {t["heartbeat_s"]}
quorum_s = 120.0
heartbeat_interval_s = 1.0

[roles.policy]
min_replicas = 1
n_init_replicas = {replicas}
join_timeout_s = {t["join_timeout_s"]}

{rep}
[train]
steps = {steps}
global_batch_size = {batch or s.batch}
micro_batch_size = {micro or s.micro}
optimizer = "adamw"
lr = 1e-3
weight_decay = 0.1
threads = 1

[train.model]
path = {json.dumps(_abs(model or s.model))}
attn_implementation = "sdpa"

[train.data]
path = {json.dumps(str(data / "train.jsonl"))}
seq_len = {s.seq_len}
validation = {json.dumps(str(data / "validation.jsonl"))}
val_samples = {s.val_samples}
cache_dir = {json.dumps(_abs(s.cache_dir))}

{dl}"""
    )
    return path


def phalanx_run(
    ch: Children, run_dir: Path, cfg: Path, label: str, chaos: str | None = None
) -> dict[str, Any]:
    """``phalanx run cfg`` to its end; its summary, and every step line of its
    replicas' logs (with ``_replica``: the log's name)."""
    cmd = [PY, "-m", "phalanx.cli", "run", str(cfg), "--plain", "--json"]
    cmd += ["--run-dir", str(run_dir)] + (["--chaos", chaos] if chaos else [])
    c = ch.spawn(cmd, label)
    summary = c.wait(
        lambda: next((e for e in c.events if e.get("event") == "summary"), None),
        f"{label}'s summary",
        timeout=7200,
    )
    c.proc.wait(timeout=120)
    steps = []
    for log in sorted(run_dir.glob("policy-*.log")):
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    e = json.loads(line)
                except ValueError:
                    continue
                if e.get("event") == "step":
                    steps.append({**e, "_replica": log.stem})
    return {"summary": summary, "steps": steps}


def commit_times(steps: list[dict[str, Any]]) -> dict[int, float]:
    """Step -> when the job committed it (its first replica's line)."""
    out: dict[int, float] = {}
    for e in steps:
        out[e["step"]] = min(out.get(e["step"], e["t"]), e["t"])
    return out


def goodput_arm(ch: Children, tmp: Path, s: Settings, params: int) -> dict[str, Any]:
    """The FT-DDP job under ``phalanx run``, calm and then under chaos, the same
    steps: committed tokens over the chaos run's wall time (first commit to last)
    over the calm run's tokens per second over its own (first commit to last)."""
    cfg = job_toml(tmp / "goodput.toml", s, replicas=s.replicas, steps=s.goodput_steps)
    tokens_per_step = s.batch * s.seq_len
    chaos = f"kill-every={s.kill_every},restart-after={s.restart_after},seed=0"
    out: dict[str, Any] = {"kill_every_s": s.kill_every, "restart_after_s": s.restart_after}
    for name, how in (("calm", None), ("chaos", chaos)):
        r = phalanx_run(ch, tmp / f"run-{name}", cfg, f"run-{name}", how)
        ts = commit_times(r["steps"])
        if not ts or max(ts) != s.goodput_steps:
            raise RuntimeError(f"the {name} run committed steps up to {max(ts, default=0)}")
        first, last = ts[min(ts)], ts[max(ts)]
        tokens = (max(ts) - min(ts)) * tokens_per_step
        sm = r["summary"]
        out[name] = {
            "wall_s": round(last - first, 2),
            "tokens": tokens,
            "tokens_per_s": round(tokens / (last - first), 1),
            "kills": sm.get("kills"),
            "heals": sm.get("heals"),
            "longest_gap_s": sm.get("longest_gap_s"),
            "peak_mem_mb": sm.get("peak_mem_mb"),
            "summary_tokens_per_s": sm.get("tokens_per_s"),
        }
        if name == "chaos":
            out["heals"] = [
                {**_heal(e["heal"]), "replica": e["_replica"]} for e in r["steps"] if e.get("heal")
            ]
    calm, hit = out["calm"], out["chaos"]
    out["goodput"] = round(hit["tokens"] / (calm["tokens_per_s"] * hit["wall_s"]), 3)
    if out.get("heals"):
        from hsdp import broadcast_gbps

        bc = broadcast_gbps(tmp, out["heals"][0]["bytes"])
        for h in out["heals"]:
            h["gloo_broadcast_gbps"] = round(bc, 3)
            h["ratio"] = round(h["heal_gbps"] / bc, 3)
    return out


def _heal(h: dict[str, Any]) -> dict[str, Any]:
    return {
        "bytes": h["bytes"],
        "transfer_s": round(h["transfer_s"], 4),
        "wait_s": round(h["wait_s"], 4),
        "warm": h["warm"],
        "heal_gbps": round(h["bytes"] / h["transfer_s"] / 1e9, 3),
    }


def diloco_arm(ch: Children, tmp: Path, s: Settings) -> dict[str, Any]:
    """DiLoCo at H against DDP at equal tokens, from one warm start; the validation
    loss of each final model (replica 0's ``--out``, θ_global for DiLoCo)."""

    def worker(kind: str, spec: dict[str, Any]) -> Any:
        return ch.spawn([PY, WORKERS, kind, json.dumps(spec)], kind)

    if s.diloco_steps % s.diloco_h:
        raise ValueError(
            f"--diloco-steps must be a multiple of --diloco-h: got {s.diloco_steps}, {s.diloco_h}."
        )
    common = {"batch": s.diloco_batch, "micro": s.diloco_micro}
    warm_cfg = job_toml(tmp / "warm.toml", s, replicas=1, steps=s.diloco_warmup, **common)
    warm_dir = tmp / "warm-model"
    c = worker(
        "warmup",
        {"config": str(warm_cfg), "steps": s.diloco_warmup, "out": str(warm_dir), "threads": 2},
    )
    warm = c.wait(
        lambda: next((e for e in c.events if e["event"] == "warmup"), None), "the warm start", 7200
    )
    out: dict[str, Any] = {
        "replicas": s.diloco_replicas,
        "H": s.diloco_h,
        "steps": s.diloco_steps,
        "batch": s.diloco_batch,
        "tokens": s.diloco_steps * s.diloco_batch * s.seq_len,
        "warmup": warm,
    }
    finals = {}
    runs: list[tuple[str, int | None, dict[str, Any]]] = [
        ("ddp", None, {}),
        ("diloco", s.diloco_h, {}),
    ]
    for v in variants(s.diloco_variants):
        runs.append(
            (f"diloco-lr{v['outer_lr']}-m{v['outer_momentum']}-f{v['fragments']}", s.diloco_h, v)
        )
    for name, h, opts in runs:
        cfg = job_toml(
            tmp / f"{name}.toml",
            s,
            replicas=s.diloco_replicas,
            steps=s.diloco_steps,
            model=str(warm_dir),
            diloco_h=h,
            **common,
            **opts,
        )
        run_dir = tmp / f"run-{name}"
        r = phalanx_run(ch, run_dir, cfg, f"run-{name}")
        ts = commit_times(r["steps"])
        out[name] = {
            "wall_s": r["summary"].get("wall_s"),
            "committed": max(ts, default=0),
            "bytes_sent": max((e.get("bytes_sent", 0) for e in r["steps"]), default=None),
            "first_to_last_commit_s": round(ts[max(ts)] - ts[min(ts)], 1) if ts else None,
        }
        finals[name] = str(run_dir / "final" / "policy-0.safetensors")
    val_cfg = job_toml(tmp / "val.toml", s, replicas=1, steps=1, model=str(warm_dir), **common)
    v = worker("val", {"config": str(val_cfg), "files": list(finals.values()), "threads": 2})
    n = len(finals)
    v.wait(lambda: len([e for e in v.events if e["event"] == "val"]) == n, "the validation", 3600)
    got = {e["file"]: e["val_loss"] for e in v.events if e["event"] == "val"}
    for name, f in finals.items():
        out[name]["val_loss"] = round(got[f], 5)
    out["diloco_val_loss_ratio"] = round(out["diloco"]["val_loss"] / out["ddp"]["val_loss"], 4)
    out["variants"] = {
        name: {**opts, "ratio": round(out[name]["val_loss"] / out["ddp"]["val_loss"], 4)}
        for name, _, opts in runs[2:]
    }
    out["val_samples"] = s.val_samples
    return out


def variants(text: str) -> list[dict[str, Any]]:
    """``--diloco-variants``: ``LR:MOMENTUM:FRAGMENTS`` settings, comma-separated
    (``1.0:0.9:1,0.5:0.9:5``), each run as one more DiLoCo job against the same DDP."""
    out = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        if len(parts) != 3:
            raise SystemExit(
                f"train_real: --diloco-variants takes LR:MOMENTUM:FRAGMENTS items: got {item!r}."
            )
        out.append(
            {
                "outer_lr": float(parts[0]),
                "outer_momentum": float(parts[1]),
                "fragments": int(parts[2]),
            }
        )
    return out


def streaming_arm(ch: Children, tmp: Path, s: Settings) -> dict[str, Any]:
    """Streaming DiLoCo's overlap in the sync job: the same job (``--diloco-replicas``
    replicas, H = ``--streaming-h``, 2 fragments, ``--streaming-rounds`` outer rounds)
    with τ = 0 (each fragment's exchange blocks the inner step that is due) and with
    τ = H / 2 - 1 (it runs beside the next τ inner steps). The replicas' step lines
    say how long each sat blocked on exchanges (``exchange_wait_s``, cumulative);
    ``overlap`` = 1 - blocked(τ) / blocked(0), the share of the exchanges' time that
    the inner steps hid."""
    h = s.streaming_h
    tau = h // 2 - 1
    out: dict[str, Any] = {"H": h, "fragments": 2, "tau": tau, "rounds": s.streaming_rounds}
    for name, t in (("blocking", 0), ("overlapped", tau)):
        cfg = job_toml(
            tmp / f"streaming-{name}.toml",
            s,
            replicas=s.diloco_replicas,
            steps=s.streaming_rounds * h,
            batch=s.diloco_batch,
            micro=s.diloco_micro,
            diloco_h=h,
            fragments=2,
            tau=t,
        )
        r = phalanx_run(ch, tmp / f"run-streaming-{name}", cfg, f"streaming-{name}")
        last: dict[str, dict[str, Any]] = {}
        for e in r["steps"]:
            if e["step"] >= last.get(e["_replica"], {}).get("step", -1):
                last[e["_replica"]] = e
        waits = [e["exchange_wait_s"] for e in last.values()]
        out[name] = {
            "exchange_wait_s": round(sum(waits) / len(waits), 4),
            "round_s": round(sum(e["round_s"] for e in last.values()) / len(last), 3),
            "wall_s": r["summary"].get("wall_s"),
        }
    blocked = out["blocking"]["exchange_wait_s"]
    out["streaming_overlap"] = (
        round(1 - out["overlapped"]["exchange_wait_s"] / blocked, 3) if blocked > 0 else None
    )
    return out

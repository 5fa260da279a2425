"""The summary ``phalanx run`` prints at the end of a job: one line a person reads,
and the same figures as JSON (``--json``, and ``summary.json`` in the run
directory) for benchmarks to parse.

An RL job's figures come from the controller's status, the source of truth for
the ledger; an explicit rollback of the job's step is always said, with what the
ledger took back (it is on the controller's timeline too).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from phalanx.launch.local import LocalJob
    from phalanx.launch.replica import Replica
    from phalanx.protocol.status import Status


def num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def discard_text(d: dict[str, int]) -> str:
    return ", ".join(f"{k}: {v}" for k, v in sorted(d.items())) or "none"


def perf_text(r: Replica, val: tuple[float, int] | None = None) -> str:
    """``  12.3k tok/s  MFU 0.31  peak 540 MB  val 3.1021 @25`` from a training
    replica's latest step lines ('' for a built-in task, which reports none); ``val``:
    the job's latest validation loss and the step it was computed at (the quorum's
    rank 0 computes it, which may be another replica, and its line may come after
    this step's first)."""
    parts = []
    if r.tokens_per_s:
        parts.append(f"{_si(r.tokens_per_s[-1])} tok/s")
    if r.mfu is not None:
        parts.append(f"MFU {r.mfu:.3f}")
    if r.peak_mem_mb is not None:
        parts.append(f"peak {r.peak_mem_mb:.0f} MB")
    if val is None and r.val_loss is not None:
        val = (r.val_loss, r.val_step)
    if val is not None:
        parts.append(f"val {val[0]:.4f} @{val[1]}")
    return "".join(f"  {p}" for p in parts)


def _si(x: float) -> str:
    return f"{x / 1e6:.1f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e4 else f"{x:.0f}"


def rollbacks(st: Status | None) -> list[dict[str, Any]]:
    """The policy's explicit rollbacks, as the controller journaled them."""
    rs = st.roles.get("policy") if st is not None else None
    return [rb.model_dump() for rb in rs.rollbacks] if rs is not None else []


def rollback_text(rbs: list[dict[str, Any]]) -> str:
    """``; rolled back from step 62 to step 24: 19 batches, 304 prompts issued again``
    for each rollback ('' for none): a summary never hides one."""
    out = []
    for rb in rbs:
        t = f"rolled back from step {rb['from_step']} to step {rb['to_step']}"
        if rb.get("batches") is not None:
            t += f": {rb['batches']} batches, {rb['prompts']} prompts issued again"
        out.append(t)
    return "".join(f"; {t}" for t in out)


def sync_stats(reps: list[Replica]) -> tuple[int, float | None]:
    # One sync is led by its source, which reports it once (the policy leader, or a
    # rollout replica that relayed); rollout replicas report their side of the same
    # sync, so count the leader's lines and the relays.
    policy = [r for r in reps if r.role == "policy"]
    src = policy if any(r.syncs for r in policy) else reps
    ms = [m for r in src for m in r.sync_ms]
    relayed = sum(r.relayed for r in reps) if src is policy else 0
    return sum(r.syncs for r in src) + relayed, (round(sum(ms) / len(ms), 2) if ms else None)


def idle_stats(reps: list[Replica]) -> dict[str, float | None]:
    """The RL job's idle fractions (:mod:`phalanx.rl.idle`): ``policy_idle``, the mean
    over every policy ``step`` line of the time spent waiting for rollouts;
    ``rollout_idle``, the mean over every ``rollout`` line (each generation batch of
    each rollout replica) of the time spent waiting for a lease or for weights. None
    where no line gave one."""

    def mean(role: str) -> float | None:
        xs = [x for r in reps if r.role == role for x in r.idle]
        return round(sum(xs) / len(xs), 4) if xs else None

    return {"policy_idle": mean("policy"), "rollout_idle": mean("rollout")}


def idle_text(s: dict[str, Any]) -> str:
    """``, idle: policy 0.42, rollout 0.07`` ('' when neither side reported)."""
    p, r = s.get("policy_idle"), s.get("rollout_idle")
    if p is None and r is None:
        return ""
    return f", idle: policy {num(p, '.2f')}, rollout {num(r, '.2f')}"


def ft_summary(job: LocalJob) -> dict[str, Any]:
    reps = job.all_replicas()
    lead = max(reps, key=lambda r: r.step, default=None)
    top = max((r.top for r in reps), key=lambda t: t[0], default=(0, None))
    gaps = [b - a for a, b in zip(job.commit_times, job.commit_times[1:], strict=False)]
    return {
        "event": "summary",
        "job": job.cfg.job.id,
        "ok": job.error is None,
        "error": job.error,
        "steps": max(top[0], lead.step if lead else 0),
        "loss": top[1] if top[0] else None,
        "kills": sum(r.kills for r in reps),
        "heals": sum(r.heals for r in reps),
        "controller_restarts": job.controller.restarts if job.controller else 0,
        "longest_gap_s": round(max(gaps), 3) if gaps else 0.0,
        "rollbacks": rollbacks(job.status()),
        **perf_summary(reps, lead),
        "wall_s": round(time.monotonic() - job.started, 2),
        "run_dir": str(job.run_dir),
    }


def perf_summary(reps: list[Replica], lead: Replica | None) -> dict[str, Any]:
    """A training job's figures for its summary (your model; none for a built-in task):
    the median committed tokens per second over the leading replica's steps, its last
    MFU and validation loss, and the largest peak memory of any replica."""
    if lead is None or not lead.tokens_per_s:
        return {}
    rates = sorted(lead.tokens_per_s)
    peaks = [r.peak_mem_mb for r in reps if r.peak_mem_mb is not None]
    return {
        "tokens_per_s": rates[len(rates) // 2],
        "mfu": lead.mfu,
        "peak_mem_mb": max(peaks) if peaks else None,
        "val_loss": v[0] if (v := latest_val(reps)) else None,
    }


def latest_val(reps: list[Replica]) -> tuple[float, int] | None:
    """The job's latest validation loss and its step: the latest any replica's lines
    gave (the quorum's rank 0 computes it, whichever replica that is)."""
    best: tuple[float, int] | None = None
    for r in reps:
        if r.val_loss is not None and (best is None or r.val_step > best[1]):
            best = (r.val_loss, r.val_step)
    return best


def ft_line(job: LocalJob, s: dict[str, Any]) -> str:
    what = f"{s['steps']} steps"
    if job.cfg.diloco is not None:
        what = f"{s['steps']} DiLoCo rounds ({s['steps'] * job.cfg.diloco.sync_every} inner steps)"
    ctl = _controller_restarts(s)
    perf = ""
    if s.get("tokens_per_s") is not None:
        perf = f"; {s['tokens_per_s']:.0f} tokens/s"
        perf += f", MFU {s['mfu']:.3f}" if s.get("mfu") is not None else ", MFU - (no peak rate)"
        perf += f", peak memory {s['peak_mem_mb']:.0f} MB" if s.get("peak_mem_mb") else ""
        perf += f", validation loss {s['val_loss']:.4f}" if s.get("val_loss") is not None else ""
    return (
        f"job {s['job']}: {what} committed in {s['wall_s']:.1f} s, final loss "
        f"{num(s['loss'], '.5f')}{perf}; {s['kills']} replica(s) killed, {s['heals']} heal(s){ctl}"
        f"{rollback_text(s.get('rollbacks', []))}; "
        f"longest gap between commits {s['longest_gap_s']:.2f} s. Logs and final states: "
        f"{s['run_dir']}" + (f". FAILED: {s['error']}" if s["error"] else "")
    )


def _controller_restarts(s: dict[str, Any]) -> str:
    n = s.get("controller_restarts", 0)
    return f", controller restarted {n} time(s)" if n else ""


def rl_summary(job: LocalJob) -> dict[str, Any]:
    reps = job.all_replicas()
    poller = job.poller
    st = poller.latest if poller is not None else None
    rl = st.rl if st is not None else None
    hit = poller.target_hit if poller else None
    best = poller.best if poller else None
    best_r = poller.best_reward if poller else None
    last = rl.last if rl is not None else None
    syncs, sync_ms = sync_stats(reps)
    return {
        "event": "summary",
        "job": job.cfg.job.id,
        "ok": job.error is None and rl is not None and rl.finished,
        "error": job.error,
        "target": job.cfg.rl.loop.target_exact_match if job.cfg.rl else None,
        "target_reward": job.cfg.rl.loop.target_reward if job.cfg.rl else None,
        "reached": hit is not None,
        "reached_metric": poller.target_metric if poller and hit else None,
        "seconds_to_target": round(hit.at - job.started_wall, 2) if hit else None,
        "target_batch": hit.batch if hit else None,
        "target_step": hit.step if hit else None,
        "steps": rl.policy_step if rl else 0,
        "batches": last.batch + 1 if last else 0,
        "exact_match_avg": last.exact_match_avg if last else None,
        "reward_avg": last.reward_avg if last else None,
        "best_exact_match_avg": best.exact_match_avg if best else None,
        "best_reward_avg": best_r.reward_avg if best_r else None,
        "prompts": rl.prompts.issued if rl else 0,
        "trained": rl.rollouts.trained if rl else 0,
        "discarded": dict(rl.rollouts.discarded) if rl else {},
        "duplicates": rl.rollouts.duplicates_dropped if rl else 0,
        "ledger_ok": rl.ok if rl else None,
        # [rl.env]: episodes a killed replica left, finished by another from its turns.
        "episodes": (
            rl.episodes.model_dump()
            if rl and rl.episodes and job.cfg.rl and job.cfg.rl.env
            else None
        ),
        "rollbacks": rollbacks(st),
        "kills": sum(r.kills for r in reps),
        "heals": sum(r.heals for r in reps),
        "restarts": sum(max(0, r.starts - 1) for r in reps),
        "controller_restarts": job.controller.restarts if job.controller else 0,
        "syncs": syncs,
        "sync_ms_mean": sync_ms,
        **idle_stats(reps),
        "replicas": {role: sum(1 for r in reps if r.role == role) for role in job.cfg.roles},
        "wall_s": round(time.monotonic() - job.started, 2),
        "run_dir": str(job.run_dir),
    }


def rl_line(job: LocalJob, s: dict[str, Any]) -> str:
    targets = {"exact match": s["target"], "reward": s.get("target_reward")}
    if s["reached"]:
        metric = s.get("reached_metric") or "exact match"
        head = (
            f"{metric} {targets[metric]} reached at batch {s['target_batch']} (step "
            f"{s['target_step']}) in {s['seconds_to_target']:.1f} s"
        )
    elif any(v is not None for v in targets.values()):
        best = {"exact match": s["best_exact_match_avg"], "reward": s.get("best_reward_avg")}
        set_ = [k for k, v in targets.items() if v is not None]
        head = (
            f"{' or '.join(f'{k} {targets[k]}' for k in set_)} not reached in {s['batches']} "
            f"batches (best trailing mean {', '.join(f'{k} {num(best[k])}' for k in set_)}) "
            f"after {s['wall_s']:.1f} s"
        )
    else:
        head = (
            f"{s['batches']} batches trained in {s['wall_s']:.1f} s, trailing exact match "
            f"{num(s['exact_match_avg'])}"
        )
    discarded = sum(s["discarded"].values())
    sync = f"syncs {s['syncs']}" + (
        f" (mean {s['sync_ms_mean']:.1f} ms)" if s["sync_ms_mean"] is not None else ""
    )
    tail = "" if s["ledger_ok"] in (True, None) else "; LEDGER UNBALANCED"
    ep = s.get("episodes")
    episodes = (
        f"; episodes of {ep['resumed']} prompt(s) resumed ({ep['turns_carried']} turns carried)"
        if ep
        else ""
    )
    if s["error"]:
        tail += f". FAILED: {s['error']}"
    return (
        f"job {s['job']}: {head}; prompts {s['prompts']}, rollouts trained {s['trained']}, "
        f"discarded {discarded} ({discard_text(s['discarded'])}){episodes}; {s['kills']} "
        f"replica(s) killed, "
        f"{s['heals']} heal(s){_controller_restarts(s)}, {sync}{idle_text(s)}"
        f"{rollback_text(s.get('rollbacks', []))}. Logs: {s['run_dir']}{tail}"
    )

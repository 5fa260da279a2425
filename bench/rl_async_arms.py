"""The pure half of ``bench/rl_async.py``: which arms run with which dotted overrides,
and how a run's log lines become the arm's figures, ratios and reward gap. No job
runs here (``tests/unit/test_bench_rl_async.py`` tests this module alone).

Figures of one arm (every time in seconds, from the arm's launch):

- ``startup_s``: launch to the first trained batch (the first policy ``step`` line;
  TRL: its first logged reward);
- ``time_to_threshold_s``: launch to the first batch whose trailing ``window``-batch
  mean reward reaches the threshold (a full window: the batch index is at least
  ``window - 1``); ``train_s`` = ``time_to_threshold_s - startup_s``;
- ``trainer_idle`` / ``rollout_idle``: the mean of the ``idle`` fields of the policy
  ``step`` lines / the rollout replicas' ``rollout`` lines (None where no line has
  one: this checkout does not measure it);
- ``sync_effect_s``: for each weights version the policy published (the ``t`` of the
  policy ``step`` line that committed it), the time until every rollout replica
  generates with it or a newer one (the ``t`` of its first ``sync`` line at that
  version or past it), averaged over the versions (:func:`sync_effect`; None where
  the lines carry no ``t``). Measured from the logs alike in both modes: a replica's
  own ``sync_effect_s`` starts at the sync that reached it, so it misses a version a
  busy replica was never sent. The summary sets the corrected ``async2`` arm's
  (in-flight updates) against the ``waiting`` arm's, the same job with
  ``rl.engine.inflight_updates = false`` (a sync waits for generation to end):
  ``sync_effect_s``, ``sync_effect_waiting_s`` and their ratio;
- ``final_reward_gap``: the arm's trailing reward minus the sync arm's, both at the
  number of trained samples the sync arm ended at (every arm trains the same batch
  size, so that is the same batch count).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

CORRECTIONS = ("none", "decoupled", "tis_token", "tis_sequence", "mis_token", "mis_sequence")
"""Values of ``rl.grpo.correction`` (the off-policy corrections of the GRPO loss)."""
ABSENT_MEANS = {"rl.grpo.correction": "none"}
"""Overrides that a checkout without the key already runs as: plain GRPO has no
correction, so an arm asking for ``none`` runs there without the key, while one asking
for ``tis_token`` is skipped."""
CHUNK = 2
"""``rl.engine.chunk`` of every arm (see :func:`arms`)."""
ARM_KEYS = (
    "arm",
    "task",
    "time_to_threshold_s",
    "startup_s",
    "train_s",
    "time_to_threshold_ratio_vs_sync",
    "trainer_idle",
    "rollout_idle",
    "final_reward_gap",
    "sync_effect_s",
    "reached",
)
"""The keys of every arm's JSON object (``--json``), in this order."""


@dataclasses.dataclass(frozen=True)
class Arm:
    """One phalanx arm: dotted overrides on the task's job file. ``twin``: the arm with
    the same staleness and no correction (its gap is shown beside this one's)."""

    name: str
    overrides: tuple[tuple[str, str], ...]
    twin: str | None = None

    @property
    def is_async(self) -> bool:
        return self.name != "sync"


def arms(correction: str = "tis_token", inner_epochs: int = 1) -> list[Arm]:
    """The benchmark's arms: ``sync`` (on-policy: max_staleness 0, a sync every commit),
    ``async2`` and ``async4`` (max_staleness 2 and 4), each without a correction and
    with ``correction`` (named ``async2_<correction>``), ``replay``: async2 with
    ``correction``, a quarter of each batch drawn from an in-memory replay buffer, and
    ``waiting``: async2 with ``correction`` whose syncs wait for generation to end
    (``rl.engine.inflight_updates = false``), for ``sync_effect_waiting_s``.

    Every arm sets ``rl.engine.chunk`` = ``CHUNK``: a point where an update may land
    every 2 tokens, since the tasks' completions are shorter than the default 8 (an
    engine whose generation ends before its first chunk only ever syncs between
    leases, which would make in-flight updates a no-op).

    Staleness counts versions (optimizer steps), ``inner_epochs`` of them per batch.
    ``max_ahead`` (rollout batches leased or waiting beside the one in training) is set
    to let generation run as far ahead as the staleness allows, ``max(1, ceil(s /
    inner_epochs))`` batches: the controller leases only to replicas whose version the
    next batch accepts, so a batch past that would be made with weights too old for it
    and discarded as stale (a quick run with one batch more discarded 216 of 696
    rollouts)."""
    if correction not in CORRECTIONS or correction == "none":
        raise ValueError(
            f"--correction must be one of {', '.join(CORRECTIONS[1:])}: got {correction!r}. "
            f"The arms without a correction run anyway."
        )
    if inner_epochs < 1:
        raise ValueError(f"inner_epochs must be >= 1: got {inner_epochs}.")

    def loop(s: int) -> tuple[tuple[str, str], ...]:
        ahead = max(1, -(-s // inner_epochs))
        return (
            ("rl.loop.max_staleness", str(s)),
            ("rl.loop.sync_every", "1"),
            ("rl.loop.max_ahead", str(ahead)),
            ("rl.engine.chunk", str(CHUNK)),
        )

    out = [Arm("sync", (*loop(0), ("rl.grpo.correction", "none")))]
    for s in (2, 4):
        out.append(Arm(f"async{s}", (*loop(s), ("rl.grpo.correction", "none"))))
        out.append(
            Arm(
                f"async{s}_{correction}",
                (*loop(s), ("rl.grpo.correction", correction)),
                f"async{s}",
            )
        )
    replay = (("rl.loop.replay_ratio", "0.25"), ("rl.transport.replay", "memory"))
    base = next(a for a in out if a.name == f"async2_{correction}")
    out.append(Arm("replay", (*base.overrides, *replay), "async2"))
    waiting = ("rl.engine.inflight_updates", "false")
    out.append(Arm("waiting", (*base.overrides, waiting), "async2"))
    return out


def cli_overrides(arm: Arm, known: set[str]) -> list[str]:
    """``arm``'s overrides as ``--key=value`` arguments. A key of ``ABSENT_MEANS`` that
    this checkout's config lacks (not in ``known``) is left out when the arm asks for
    the behaviour its absence means; any other unknown key stays, so that validation
    names it."""
    return [
        f"--{k}={v}"
        for k, v in arm.overrides
        if k in known or ABSENT_MEANS.get(k) != v  # (an unknown key that means more stays)
    ]


def one_line(error: str) -> str:
    """A config error (one line per field) as the one line of a ``skipped`` record."""
    lines = [x.strip() for x in error.splitlines() if x.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):  # "invalid job config F:" heads the fields
        return f"{lines[0]} {'; '.join(lines[1:])}"
    return "; ".join(lines)


# -- log lines to figures ----------------------------------------------------------------


def _mean(xs: Iterable[float | None]) -> float | None:
    vals = [float(x) for x in xs if x is not None]
    return round(statistics.fmean(vals), 4) if vals else None


def batches(steps: Iterable[Mapping[str, Any]]) -> list[tuple[int, float, float]]:
    """(batch, reward, t) per trained batch, in batch order, from policy ``step`` lines.
    A batch spans ``inner_epochs`` commits (and a retried one more): its reward is the
    ledger's, the same on every line, and its time the earliest line's (its reward was
    known from the first commit on)."""
    first: dict[int, tuple[float, float]] = {}
    for e in steps:
        b, t = int(e["batch"]), float(e["t"])
        if b not in first or t < first[b][1]:
            first[b] = (float(e["reward"]), t)
    return [(b, *first[b]) for b in sorted(first)]


def trailing(rewards: Sequence[float], window: int) -> list[float | None]:
    """The trailing ``window``-batch mean after each batch; None until a window is full."""
    out: list[float | None] = []
    for i in range(len(rewards)):
        out.append(sum(rewards[i - window + 1 : i + 1]) / window if i >= window - 1 else None)
    return out


def curve_figures(
    t0: float, curve: Sequence[tuple[float, float]], threshold: float, window: int, per: int
) -> dict[str, Any]:
    """Figures of one run from its per-batch ``(t, reward)`` curve in training order
    (``per``: samples trained per batch). ``trail`` is ``[samples, trailing reward]``
    after each batch with a full window."""
    rewards = [r for _, r in curve]
    trail = trailing(rewards, window)
    hit = next((i for i, m in enumerate(trail) if m is not None and m >= threshold), None)
    startup = curve[0][0] - t0 if curve else None
    at = curve[hit][0] - t0 if hit is not None else None
    return {
        "time_to_threshold_s": _r(at),
        "startup_s": _r(startup),
        "train_s": _r(at - startup) if at is not None and startup is not None else None,
        "reached": hit is not None,
        "batches_to_threshold": hit + 1 if hit is not None else None,
        "batches": len(curve),
        "samples": len(curve) * per,
        "trail": [[(i + 1) * per, round(m, 4)] for i, m in enumerate(trail) if m is not None],
    }


def phalanx_figures(
    t0: float,
    policy: Iterable[Mapping[str, Any]],
    rollout: Iterable[Mapping[str, Any]],
    threshold: float,
    window: int,
    per: int,
) -> dict[str, Any]:
    """An arm's figures from its replicas' JSON log lines (``policy``: every policy
    replica's, ``rollout``: every rollout replica's; other events are ignored)."""
    steps = [e for e in policy if e.get("event") == "step"]
    rol = list(rollout)
    out = curve_figures(t0, [(t, r) for _, r, t in batches(steps)], threshold, window, per)
    out["trainer_idle"] = _mean(e.get("idle") for e in steps)
    out["rollout_idle"] = _mean(e.get("idle") for e in rol if e.get("event") == "rollout")
    out["sync_effect_s"] = sync_effect(steps, rol)
    out["staleness"] = _mean(e.get("staleness") for e in steps)
    return out


def sync_effect(
    steps: Iterable[Mapping[str, Any]], rollout: Iterable[Mapping[str, Any]]
) -> float | None:
    """The mean over published versions v of the seconds from v's publish (the first
    policy ``step`` line at ``version`` v) to the last rollout replica holding v or a
    newer one (the first of its successful ``sync`` lines at such a version). A
    version no replica ever held (the job ended first) is left out; None when no
    version counts (lines without ``t``)."""
    published: dict[int, float] = {}
    for e in steps:
        if e.get("version") is not None and e.get("t") is not None:
            v, t = int(e["version"]), float(e["t"])
            published[v] = min(t, published.get(v, t))
    held: dict[str, list[tuple[float, int]]] = {}
    for e in rollout:
        if e.get("event") == "sync" and e.get("ok") and e.get("t") is not None:
            held.setdefault(str(e["replica"]), []).append((float(e["t"]), int(e["version"])))
    effects = []
    for v, t_pub in sorted(published.items()):
        firsts = [min((t for t, ver in got if ver >= v), default=None) for got in held.values()]
        reached = [t for t in firsts if t is not None]
        if reached:
            effects.append(max(max(reached) - t_pub, 0.0))
    return _mean(effects)


def reward_at(trail: Sequence[Sequence[float]], samples: int) -> float | None:
    """The trailing reward after exactly ``samples`` trained samples (None: the run
    did not train that many, or its window was not yet full)."""
    return next((float(m) for s, m in trail if s == samples), None)


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


# -- across arms ---------------------------------------------------------------------------


def compare(results: list[dict[str, Any]], specs: Sequence[Arm]) -> dict[str, Any]:
    """Fill each phalanx arm's ``time_to_threshold_ratio_vs_sync`` and ``final_reward_gap``
    (in place) and return the task's summary: the best async arm by time to threshold,
    its ratio and gap, its no-correction twin's gap, and ``ratio_vs_trl`` (phalanx's
    best arm, sync included, over TRL's time). ``results``: one task's records
    (skipped ones carry ``skipped``); TRL's is the one named ``trl``."""
    twin = {a.name: a.twin for a in specs}
    ran = {r["arm"]: r for r in results if "skipped" not in r}
    sync = ran.get("sync")
    final = sync["samples"] if sync else None
    base_t = sync.get("time_to_threshold_s") if sync else None
    base_r = reward_at(sync["trail"], final) if sync and final else None
    phalanx = [r for name, r in ran.items() if name in twin]
    for r in phalanx:
        t = r.get("time_to_threshold_s")
        r["time_to_threshold_ratio_vs_sync"] = (
            round(t / base_t, 3) if r["arm"] != "sync" and t and base_t else None
        )
        mine = reward_at(r["trail"], final) if final else None
        gap = (
            mine - base_r
            if r["arm"] != "sync" and mine is not None and base_r is not None
            else None
        )
        r["final_reward_gap"] = _r(gap, 4)
    timed = [r for r in phalanx if r.get("time_to_threshold_s") is not None]
    best = min((r for r in timed if r["arm"] != "sync"), key=_time, default=None)
    best_any = min(timed, key=_time, default=None)
    trl = ran.get("trl")
    trl_t = trl.get("time_to_threshold_s") if trl else None
    no_corr = ran.get(twin.get(best["arm"]) or "") if best else None
    inflight = next((r for n, r in ran.items() if n.startswith("async2_")), None)
    effect = inflight.get("sync_effect_s") if inflight else None
    waited = ran["waiting"].get("sync_effect_s") if "waiting" in ran else None
    return {
        "best_async_arm": best["arm"] if best else None,
        "time_to_threshold_ratio_vs_sync": best["time_to_threshold_ratio_vs_sync"]
        if best
        else None,
        "final_reward_gap": best["final_reward_gap"] if best else None,
        "no_correction_arm": (no_corr or best or {}).get("arm"),
        "final_reward_gap_no_correction": (no_corr or best or {}).get("final_reward_gap"),
        "final_samples": final,
        "best_arm": best_any["arm"] if best_any else None,
        "trl_time_to_threshold_s": trl_t,
        "trl_startup_s": trl.get("startup_s") if trl else None,
        "trl_train_s": trl.get("train_s") if trl else None,
        "ratio_vs_trl": round(_time(best_any) / trl_t, 3) if best_any and trl_t else None,
        "sync_effect_s": effect,
        "sync_effect_waiting_s": waited,
        "sync_effect_ratio": round(effect / waited, 3) if effect and waited else None,
    }


def _time(r: Mapping[str, Any]) -> float:
    return float(r["time_to_threshold_s"])


def arm_record(r: Mapping[str, Any]) -> dict[str, Any]:
    """An arm's JSON object: ``ARM_KEYS`` (None where not measured), or its skip."""
    if "skipped" in r:
        return {"arm": r["arm"], "task": r["task"], "skipped": r["skipped"]}
    return {k: r.get(k) for k in ARM_KEYS}

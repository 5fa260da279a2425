"""The job at a glance: what the dashboard, ``phalanx status`` and ``/metrics`` show.

Derived, read-only, from the state machine's records (members, quorums, events,
the ledger) and computed per status request. Like the state machine it does no
I/O and reads no clock: ``now`` is monotonic, ``wall`` the wall-clock time of
the request (``None`` leaves uptimes out).

Replica states, in the order they are decided:

- ``suspected``: a peer reported it, or its held connection dropped; it is
  evicted unless it heartbeats within ``suspect_grace_s``.
- ``healing``: in the role's latest quorum, but behind: a peer heals it.
- ``active``: in the latest quorum, up to date (or, for a role that forms no
  quorums such as ``rollout``, holding weights).
- ``joining``: registered, not yet part of a quorum (or holding no weights).
- ``evicted``: gone (the recent ones are listed apart, with the detector).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from phalanx.controller.core.event_text import describe
from phalanx.protocol.status import Overview

if TYPE_CHECKING:
    from phalanx.controller.core.records import Member, RoleState
    from phalanx.controller.core.state import ControllerState

RATE_WINDOW_S = 30.0
"""Steps per second are measured over the last this-many seconds of step growth."""
RECENT_EVICTIONS = 10
SERIES_POINTS = 500
TIMELINE = 200
TIMELINE_KINDS = (
    "controller_start",
    "join",
    "active",
    "healed",
    "evict",
    "quorum",
    "checkpoint",
    "checkpoint_requested",
    "sync_done",
    "sync_failed",
    "sync_short",
    "scale",
    "drain",
    "rl_final_step",
    "rl_finished",
    "rollback",
    "journal_record_dropped",
)
DETECTORS = ("failure_report", "heartbeat", "disconnect", "agent", "replaced", "operator", "left")


def detector_of(reason: str) -> str:
    """Which failure detector fired, from an eviction's reason (see DESIGN.md, Failure)."""
    if reason.startswith("failure report"):
        return "failure_report"
    if reason.startswith("held connection dropped"):
        return "disconnect"
    if reason == "heartbeat timeout":
        return "heartbeat"
    if "reported by agent" in reason:
        return "agent"
    if reason.startswith("replaced"):
        return "replaced"
    if reason.startswith("evicted by operator"):
        return "operator"
    if reason.startswith("straggler"):
        return "straggler"
    return "left"


def steps_per_s(rs: RoleState, now: float) -> float:
    pts = [(t, s) for t, s in rs.steps_seen if now - t <= RATE_WINDOW_S]
    if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
        return 0.0
    return round((pts[-1][1] - pts[0][1]) / (now - pts[0][0]), 3)


def replica_state(st: ControllerState, rs: RoleState, m: Member) -> str:
    if m.suspect_since is not None:
        return "suspected"
    last = rs.last_quorum
    if last is not None and m.replica_id in last.heal:
        return "healing"
    if last is not None and m.replica_id in rs.prev_ids:  # the last quorum's, as a set
        return "active"
    if last is None and st.ledger is not None and rs.name == "rollout":
        return "active" if st.ledger.weights.versions.get(m.replica_id, -1) >= 0 else "joining"
    return "joining"


def _replica(st: ControllerState, rs: RoleState, m: Member, now: float, wall: float | None):
    version: int | None = m.step if rs.name == "policy" else None
    if st.ledger is not None and rs.name == "rollout":
        version = st.ledger.weights.versions.get(m.replica_id)
    return {
        "replica_id": m.replica_id,
        "name": m.name,
        "incarnation": m.replica_id.rpartition(":")[2],
        "state": replica_state(st, rs, m),
        "uptime_s": None if wall is None else round(max(0.0, wall - m.registered_at), 1),
        "weights_version": version,
        "heartbeat_age_s": round(now - m.last_seen, 3),
        "address": m.address,
        "step": m.step,
        "loss": m.loss,
        "inner_step": m.inner_step,
        "commands_pending": st.commands.count(m.replica_id),
    }


def _leader_sync(ev: dict[str, Any]) -> bool:
    return ev["kind"] == "sync_done" and ev.get("source_role", "policy") == "policy"


def _timeline(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The events worth a line. An RL job syncs weights after every batch: a run of
    ``sync_done`` with nothing in between becomes one event (the last, with ``runs``,
    ``first_seq`` and ``first_version``), so joins and evictions stay in sight. A sync
    a rollout peer relayed (to a joiner) keeps its own line, naming the source."""
    out: list[dict[str, Any]] = []
    for ev in events:
        if ev["kind"] not in TIMELINE_KINDS:
            continue
        if ev["kind"] == "quorum" and not (ev.get("recovered") or ev.get("healing")):
            continue  # a routine re-formation says nothing new
        prev = out[-1] if out else None
        if _leader_sync(ev) and prev is not None and _leader_sync(prev):
            out[-1] = {
                **ev,
                "runs": prev.get("runs", 1) + 1,
                "first_seq": prev.get("first_seq", prev.get("seq")),
                "first_version": prev.get("first_version", prev.get("version")),
            }
            continue
        out.append(ev)
    return [{**ev, "text": describe(ev)} for ev in out[-TIMELINE:]]


def overview(st: ControllerState, now: float, wall: float | None = None) -> Overview:
    """Everything the dashboard shows, in the shape documented in docs/operations.md."""
    roles: dict[str, Any] = {}
    for name, rs in st.roles.items():
        last = rs.last_quorum
        evicted = [
            {
                "replica_id": e["replica_id"],
                "at": e["at"],
                "detector": e.get("detector", detector_of(e.get("reason", ""))),
                "reason": e.get("reason", ""),
                "state": "evicted",
            }
            for e in st.events
            if e["kind"] == "evict" and e.get("role") == name
        ][-RECENT_EVICTIONS:]
        roles[name] = {
            # RL rollout replicas form no quorums: their step and quorum say nothing.
            "forms_quorums": not (st.ledger is not None and name == "rollout"),
            "step": rs.step,
            "quorum_id": rs.quorum_id,
            "quorum_size": len(last.members) if last else 0,
            "steps_per_s": steps_per_s(rs, now),
            "desired": st.desired.get(name),
            "replicas": [_replica(st, rs, m, now, wall) for m in st.alive(name)],
            "evicted": evicted,
        }
    main = "policy" if "policy" in roles else next(iter(roles))
    job: dict[str, Any] = {
        "step": roles[main]["step"],
        "quorum_id": roles[main]["quorum_id"],
        "steps_per_s": roles[main]["steps_per_s"],
    }
    series: dict[str, list[list[float]]] = {
        "loss": [[s, x] for s, x in st.roles[main].losses][-SERIES_POINTS:]
    }
    ledger = None
    if st.ledger is not None:
        hist = st.ledger.rollouts.history
        last_batch = hist[-1] if hist else {}
        job["rl"] = {
            k: last_batch.get(k)
            for k in (
                "batch",
                "reward",
                "reward_avg",
                "exact_match",
                "exact_match_avg",
                "staleness",
                "tokens_per_s",
            )
        }
        measured = last_batch.get("metrics") or {}
        job["rl"]["policy_idle"] = measured.get("idle")
        for key in (
            "train_tokens_per_s",
            "mismatch_kl",
            "ess",
            "is_clip_frac",
            "is_mask_frac",
            "staleness_tokens",
        ):
            job["rl"][key] = measured.get(key)
        series["reward"] = [[h["step"], h["reward"]] for h in hist][-SERIES_POINTS:]
        series["exact_match"] = [[h["step"], h["exact_match"]] for h in hist][-SERIES_POINTS:]
        b = st.ledger.balance()
        p, r = b["prompts"], b["rollouts"]
        ledger = {
            "ok": b["ok"],
            "prompts_issued": p["issued"],
            "prompts_queued": p["queued"],
            "prompts_leased": p["leased"],
            "prompts_done": p["done"],
            "prompts_trained": p["trained"],
            "rollouts_pending": r["pending"],
            "rollouts_batched": r["batched"],
            "rollouts_trained": r["trained"],
            "rollouts_discarded": dict(sorted(r["discarded"].items())),
            "duplicates_dropped": r["duplicates_dropped"],
            "unleased_refused": r["unleased_refused"],
            "episode_reports": st.ledger.counts["episode_reports"],
            "episodes_resumed": st.ledger.counts["episodes_resumed"],
            "episode_turns_carried": st.ledger.counts["episode_turns_carried"],
            "episode_bytes": st.ledger.episodes.bytes,
            "weights_version": st.ledger.weights.synced_version,
        }
    if st.cfg.diloco is not None:
        h = st.cfg.diloco.sync_every
        # Committed rounds x H, or further while a round runs: the replicas report
        # their inner steps with their heartbeats.
        live = [m.inner_step for m in st.alive(main) if m.inner_step is not None]
        inner = max([job["step"] * h, *live])
        job["diloco"] = {"outer_step": job["step"], "inner_step": inner, "sync_every": h}
    return Overview.model_validate(
        {
            "job": job,
            "roles": roles,
            "ledger": ledger,
            "series": series,
            "timeline": _timeline(st.events),
            "checkpoints": [c.model_dump() for c in reversed(st.checkpoints.records)],
            "actions": {
                "checkpoint": bool(st.cfg.checkpoint.url) and "policy" in st.roles,
                "scale": True,
            },
        },
        strict=False,  # built here: lists stand for tuples
    )

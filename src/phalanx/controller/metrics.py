"""The controller's Prometheus metrics (``GET /metrics``).

Counters and the quorum-wait histogram are updated as requests are served;
everything else is read at scrape time from the same overview the dashboard
shows (:func:`phalanx.controller.core.overview.overview`), so the two never
disagree. Names carry the ``phalanx_`` prefix and their unit; the scrape
config and the main queries are in docs/operations.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from phalanx.controller.core.overview import overview

if TYPE_CHECKING:
    from phalanx.controller.core.records import RoleState
    from phalanx.controller.service import ControllerService

REPLICA_STATES = ("joining", "healing", "active", "suspected")


def _count(role: RoleState) -> int:
    return len(role.member_ids)


def _rollbacks(role: RoleState) -> int:
    return len(role.rollbacks)


def _rolled_back_steps(role: RoleState) -> int:
    return sum(rb["from_step"] - rb["to_step"] for rb in role.rollbacks)


def _gauge(name: str, doc: str, labels: list[str] | None = None) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


class OverviewCollector(Collector):
    """Per-replica, job, RL-ledger, DiLoCo and checkpoint figures, read per scrape."""

    def __init__(self, service: ControllerService):
        self.service = service

    def collect(self) -> Iterator[Any]:
        svc = self.service
        ov = overview(svc.state, svc.clock(), svc.wall()).model_dump()
        rl = ["role", "replica_id"]
        by_state = _gauge(
            "phalanx_replicas_by_state", "Live replicas per state.", ["role", "state"]
        )
        info = _gauge(
            "phalanx_replica_info",
            "One per live replica (1), with its name, incarnation, state and address.",
            [*rl, "name", "incarnation", "state", "address"],
        )
        uptime = _gauge("phalanx_replica_uptime_seconds", "Since the incarnation registered.", rl)
        hb = _gauge("phalanx_replica_heartbeat_age_seconds", "Since its last heartbeat.", rl)
        ver = _gauge("phalanx_replica_weights_version", "Weights version (policy step) held.", rl)
        step = _gauge("phalanx_replica_step", "Committed step the replica reported.", rl)
        rate = _gauge("phalanx_steps_per_second", "Committed steps per second (30 s).", ["role"])
        qsize = _gauge("phalanx_quorum_size_replicas", "Members of the latest quorum.", ["role"])
        desired = _gauge("phalanx_desired_replicas", "Replica count set by scale.", ["role"])
        recovery = _gauge(
            "phalanx_last_recovery_seconds",
            "Time from a replica's failure to the role's next quorum, for the latest one.",
            ["role", "detector"],
        )
        for role, r in ov["roles"].items():
            rate.add_metric([role], r["steps_per_s"])
            qsize.add_metric([role], r["quorum_size"])
            if r["desired"] is not None:
                desired.add_metric([role], r["desired"])
            counts = dict.fromkeys(REPLICA_STATES, 0)
            for x in r["replicas"]:
                counts[x["state"]] = counts.get(x["state"], 0) + 1
                key = [role, x["replica_id"]]
                info.add_metric([*key, x["name"], x["incarnation"], x["state"], x["address"]], 1)
                if x["uptime_s"] is not None:
                    uptime.add_metric(key, x["uptime_s"])
                hb.add_metric(key, x["heartbeat_age_s"])
                step.add_metric(key, x["step"])
                if x["weights_version"] is not None:
                    ver.add_metric(key, x["weights_version"])
            for state, n in counts.items():
                by_state.add_metric([role, state], n)
        seen: set[tuple[str, str]] = set()
        for ev in reversed(ov["timeline"]):
            for rec in ev.get("recovered", []):
                rd = (ev["role"], rec["detector"])
                if rd not in seen:
                    seen.add(rd)
                    recovery.add_metric(list(rd), rec["seconds"])
        yield from (by_state, info, uptime, hb, ver, step, rate, qsize, desired, recovery)
        yield from self._job(ov)

    def _job(self, ov: dict[str, Any]) -> Iterator[Any]:
        loss = ov["series"]["loss"]
        if loss:
            yield _single("phalanx_loss", "Latest training loss reported.", loss[-1][1])
        rl = ov["job"].get("rl")
        if rl:
            for key, doc in (
                ("reward", "Mean reward of the latest trained batch."),
                ("reward_avg", "Trailing mean reward (rl.loop.window batches)."),
                ("exact_match", "Exact-match accuracy of the latest trained batch (0-1)."),
                ("exact_match_avg", "Trailing mean exact-match accuracy (0-1)."),
                ("staleness", "Staleness of the latest batch, in policy steps."),
                ("tokens_per_s", "Completion tokens trained per wall second (latest batch)."),
                ("train_tokens_per_s", "Policy tokens through forward and backward per second."),
                ("mismatch_kl", "k3 KL(behaviour || trainer) per token, latest batch."),
                ("ess", "Effective sample size fraction of the importance weights (0-1)."),
                ("is_clip_frac", "Fraction of tokens whose importance weight was truncated."),
                ("is_mask_frac", "Fraction of tokens masked out of the loss (MIS)."),
                ("policy_idle", "Fraction of the policy's time spent waiting for rollouts."),
            ):
                if rl.get(key) is not None:
                    name = (
                        "phalanx_rl_staleness_steps" if key == "staleness" else f"phalanx_rl_{key}"
                    )
                    yield _single(name, doc, rl[key])
            if rl.get("staleness_tokens"):
                hist = _gauge(
                    "phalanx_rl_staleness_tokens",
                    "Completion tokens of the latest batch per staleness (policy steps).",
                    ["staleness"],
                )
                for lag, n in sorted(rl["staleness_tokens"].items(), key=lambda kv: int(kv[0])):
                    hist.add_metric([lag], n)
                yield hist
        led = ov["ledger"]
        if led:
            prompts = _gauge("phalanx_ledger_prompts", "Prompts by state.", ["state"])
            for state in ("issued", "queued", "leased", "done", "trained"):
                prompts.add_metric([state], led[f"prompts_{state}"])
            rollouts = _gauge("phalanx_ledger_rollouts", "Rollouts by state.", ["state"])
            for state in ("pending", "batched", "trained"):
                rollouts.add_metric([state], led[f"rollouts_{state}"])
            disc = _gauge(
                "phalanx_ledger_rollouts_discarded", "Rollouts discarded, by reason.", ["reason"]
            )
            for reason, n in led["rollouts_discarded"].items():
                disc.add_metric([reason], n)
            yield from (prompts, rollouts, disc)
            yield _single(
                "phalanx_ledger_duplicates_dropped",
                "Duplicate rollouts dropped.",
                led["duplicates_dropped"],
            )
            yield _single(
                "phalanx_ledger_unleased_refused",
                "Rollouts refused: submitted under a lease that never held their prompt.",
                led["unleased_refused"],
            )
            for key, doc in (
                ("episode_reports", "Multi-turn episode progress reports kept."),
                ("episodes_resumed", "Prompts dispatched again with their episodes' progress."),
                ("episode_turns_carried", "Completed episode turns carried to a new holder."),
                ("episode_bytes", "Bytes of episode progress held now."),
            ):
                yield _single(f"phalanx_ledger_{key}", doc, led[key])
            yield _single("phalanx_ledger_balanced", "1 when the ledger balances.", int(led["ok"]))
            yield _single(
                "phalanx_rl_weights_version",
                "Weights version last synced to rollouts.",
                led["weights_version"],
            )
        dl = ov["job"].get("diloco")
        if dl:
            yield _single(
                "phalanx_diloco_outer_step", "DiLoCo outer steps committed.", dl["outer_step"]
            )
            yield _single(
                "phalanx_diloco_inner_step", "DiLoCo inner steps committed.", dl["inner_step"]
            )
        cks = ov["checkpoints"]
        if cks:
            yield _single(
                "phalanx_checkpoint_step", "Step of the latest checkpoint.", cks[0]["step"]
            )
            yield _single(
                "phalanx_checkpoint_bytes", "Size of the latest checkpoint.", cks[0]["nbytes"]
            )
            yield _single(
                "phalanx_checkpoint_timestamp_seconds",
                "When the latest checkpoint committed.",
                cks[0]["at"],
            )


class StragglerCollector(Collector):
    """The straggler watch's counters and each watched replica's share, per scrape
    (:mod:`phalanx.controller.core.stragglers`; counted since the controller
    started)."""

    def __init__(self, service: ControllerService):
        self.service = service

    def collect(self) -> Iterator[Any]:
        fig = self.service.state.stragglers.figures()
        flagged = CounterMetricFamily(
            "phalanx_straggler_flagged",
            "Replicas flagged as stragglers (a share time past factor x their peers' median).",
            labels=["role"],
        )
        evicted = CounterMetricFamily(
            "phalanx_straggler_evicted",
            "Stragglers evicted: still too slow at the floor share (controller.stragglers).",
            labels=["role"],
        )
        for role in self.service.state.roles:
            flagged.add_metric([role], fig["flagged"].get(role, 0))
            evicted.add_metric([role], fig["evicted"].get(role, 0))
        share = _gauge(
            "phalanx_replica_share",
            "A watched replica's share of the global batch, as a fraction of an equal share.",
            ["role", "replica_id"],
        )
        for rid, (role, value) in sorted(fig["shares"].items()):
            share.add_metric([role, rid], value)
        yield from (flagged, evicted, share)


def _single(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class Metrics:
    def __init__(self, service: ControllerService):
        r = self.registry = CollectorRegistry()
        self.heartbeats = Counter("phalanx_heartbeats", "Heartbeats received.", registry=r)
        self.quorums = Counter("phalanx_quorums", "Quorums formed.", ["role"], registry=r)
        self.evictions = Counter(
            "phalanx_evictions", "Replicas evicted.", ["role", "reason"], registry=r
        )
        self.evictions_by_detector = Counter(
            "phalanx_evictions_by_detector",
            "Replicas evicted, by the detector that fired.",
            ["role", "detector"],
            registry=r,
        )
        self.reports = Counter("phalanx_failure_reports", "Failure reports received.", registry=r)
        self.member_lists = Counter(
            "phalanx_quorum_member_lists",
            "Quorum member lists served: whole (kind=full) or as the difference from a list "
            "the replica held (kind=delta). About one per replica per change of membership.",
            ["kind"],
            registry=r,
        )
        self.commands = Counter("phalanx_commands", "Commands queued.", ["kind"], registry=r)
        self.journal_writes = Counter(
            "phalanx_journal_writes", "Journal transactions committed.", registry=r
        )
        self.quorum_wait = Histogram(
            "phalanx_quorum_wait_seconds",
            "Time from a quorum request to its answer.",
            ["role"],
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=r,
        )
        self._quorum_wait_of: dict[str, Any] = {}
        self.heal_seconds = Histogram(
            "phalanx_heal_seconds",
            "Time a replica took to receive and load the state it healed from a peer.",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        replicas = Gauge("phalanx_replicas", "Live replicas.", ["role"], registry=r)
        quorum_id = Gauge("phalanx_quorum_id", "Current quorum id.", ["role"], registry=r)
        step = Gauge("phalanx_step", "Highest committed step seen.", ["role"], registry=r)
        rollbacks = Gauge(
            "phalanx_rollbacks",
            "Explicit rollbacks of the role's step: no replica and no checkpoint held it "
            "(journaled, the last 64).",
            ["role"],
            registry=r,
        )
        rolled_back = Gauge(
            "phalanx_rolled_back_steps",
            "Committed steps those rollbacks took back (trained again).",
            ["role"],
            registry=r,
        )
        epoch = Gauge("phalanx_controller_epoch", "Controller epoch.", registry=r)
        epoch.set_function(lambda: service.state.epoch)
        for role in service.state.roles.values():
            replicas.labels(role.name).set_function(partial(_count, role))
            quorum_id.labels(role.name).set_function(partial(getattr, role, "quorum_id"))
            step.labels(role.name).set_function(partial(getattr, role, "step"))
            rollbacks.labels(role.name).set_function(partial(_rollbacks, role))
            rolled_back.labels(role.name).set_function(partial(_rolled_back_steps, role))
        r.register(OverviewCollector(service))
        r.register(StragglerCollector(service))

    def quorum_waited(self, role: str, seconds: float) -> None:
        """Observe one quorum request's wait (the role's child kept: ``labels()`` took a
        lock and a lookup on each of a round's N requests)."""
        child = self._quorum_wait_of.get(role)
        if child is None:
            child = self._quorum_wait_of[role] = self.quorum_wait.labels(role)
        child.observe(seconds)

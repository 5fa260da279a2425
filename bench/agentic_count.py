"""The pure half of ``bench/agentic.py``: a job's JSON lines to its figures. No job
runs here and nothing is read from disk (``tests/unit/test_bench_agentic.py`` tests
this module alone).

The lines are the rollout replica's (``jobs/rl_rollout.py``, ``rl/agentic/replica.py``):

- ``turn``: one per model turn the process *generated* (a replayed turn prints none),
  printed right after the turn was reported to the controller: ``rollout`` (its
  prompt's rollout id, the same across dispatches of one attempt), ``sample``,
  ``tokens``, ``versions``, ``t``;
- ``rollout``: one per lease submitted: ``rollouts`` (ids), ``turns``,
  ``replayed_turns`` (turns answered from a lost holder's report), ``aborted_turns``,
  ``gen_s`` (from the lease's first generation to just before its submission),
  ``t`` (after the submission);
- ``abandoned``: a lease given up because a weight update in flight failed
  part-way: ``rollouts``;
- ``sync``: one per weight sync: ``inflight`` (taken during a generation), ``ok``.

A process is a list of its lines; a killed one comes with the wall time of its kill.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

Events = list[dict[str, Any]]


@dataclass
class Proc:
    """One process of a rollout replica (an incarnation) and what it printed."""

    label: str
    events: Events
    killed_at: float | None = None


def of(events: Events, kind: str) -> Events:
    return [e for e in events if e.get("event") == kind]


def throughput(procs: list[Proc]) -> dict[str, Any]:
    """``turns_per_s``: the ``turn`` lines of every rollout process over the job's
    generation wall time, from the earliest start of a lease's generation (a
    ``rollout`` line's ``t - gen_s``) to the last submission (the latest ``t``); turns
    printed after that (a lease a stopped process never submitted) are left out."""
    rolls = [e for p in procs for e in of(p.events, "rollout")]
    if not rolls:
        return {"turns": 0, "gen_wall_s": None, "turns_per_s": None, "leases": 0}
    start = min(e["t"] - e["gen_s"] for e in rolls)
    end = max(e["t"] for e in rolls)
    turns = [e for p in procs for e in of(p.events, "turn") if start <= e["t"] <= end]
    wall = end - start
    return {
        "turns": len(turns),
        "turn_tokens": sum(e["tokens"] for e in turns),
        "gen_wall_s": round(wall, 3),
        "turns_per_s": round(len(turns) / wall, 3) if wall > 0 else None,
        "turn_tokens_per_s": round(sum(e["tokens"] for e in turns) / wall, 1) if wall else None,
        "leases": len(rolls),
        "turns_per_lease": round(sum(e["turns"] for e in rolls) / len(rolls), 2),
    }


def aborted(procs: list[Proc], group_size: int) -> dict[str, Any]:
    """``aborted_turns_per_update``: the turns abandoned (each ``abandoned`` lease's
    ``aborted_turns``: its episodes, ``group_size`` per rollout, each with its turn in
    flight) over the weight updates that landed during a
    generation (``sync`` lines with ``inflight`` and ``ok``: ``inflight_updates``).
    ``turns_across_versions``: turns whose tokens came from more than one weights
    version (an update landed inside the turn, which went on)."""
    evs = [e for p in procs for e in p.events]
    gave_up = of(evs, "abandoned")
    n_aborted = sum(e.get("aborted_turns", len(e["rollouts"]) * group_size) for e in gave_up)
    syncs = of(evs, "sync")
    inflight = [e for e in syncs if e.get("inflight") and e.get("ok")]
    return {
        "aborted_turns": n_aborted,
        "abandoned_leases": len(gave_up),
        "inflight_updates": len(inflight),
        "updates": sum(bool(e.get("ok")) for e in syncs),
        "failed_updates": sum(not e.get("ok") for e in syncs),
        "aborted_turns_per_update": round(n_aborted / len(inflight), 3) if inflight else None,
        "turns_across_versions": sum(len(e["versions"]) > 1 for e in of(evs, "turn")),
        "turns": len(of(evs, "turn")),
    }


@dataclass
class _Left:
    """Turns killed processes made for one rollout and did not submit themselves."""

    fresh: int = 0
    by: list[Proc] = field(default_factory=list)


def lost_turns(procs: list[Proc]) -> dict[str, Any]:
    """Turns lost to SIGKILLs, per kill.

    A turn is *lost* when a killed process completed it (a ``turn`` line) but it
    reached no trained batch's rollout: the process did not submit that rollout
    itself, and the rollout's next holder did not replay it. For each rollout ``R``
    some killed processes made turns of and did not submit, its *final submission* is
    the first ``rollout`` line, from any process, that lists ``R`` after the last of
    those kills; with one rollout per lease (``rl.loop.prompts_per_lease = 1``), that
    line's ``replayed_turns`` are ``R``'s turns carried to the submitter (with more
    rollouts per lease the counts are those of the lease, summed over its rollouts).
    Then, per final submission, lost = max(0, turns the killed processes made -
    replayed); ``carried_without_line``: replayed beyond them (a turn reported just
    before the kill, its line never printed). A rollout nobody submitted before the
    run stopped is ``unresolved`` (its turns counted apart, not as lost).

    ``inflight_episodes``: per kill, the episodes of the rollouts it left whose next
    holder (the first process after the kill to print a turn of, or submit, ``R``)
    generated a turn for them: episodes interrupted between their first and last
    turn, the kill costing the turn each had in flight (the design's allowance).
    """
    submitted: dict[str, list[tuple[float, Proc, dict[str, Any]]]] = defaultdict(list)
    for p in procs:
        for e in of(p.events, "rollout"):
            for r in e["rollouts"]:
                submitted[r].append((e["t"], p, e))
    left: dict[str, _Left] = defaultdict(_Left)
    killed = [p for p in procs if p.killed_at is not None]
    left_by_kill: dict[str, set[str]] = {}
    for p in killed:
        own = {r for e in of(p.events, "rollout") for r in e["rollouts"]}
        made = Counter(e["rollout"] for e in of(p.events, "turn") if e["rollout"] not in own)
        left_by_kill[p.label] = set(made)
        for r, n in made.items():
            left[r].fresh += n
            left[r].by.append(p)
    lost = carried = over = unresolved = made_total = 0
    per_lease: dict[int, tuple[dict[str, Any], int]] = {}
    for r, lf in left.items():
        made_total += lf.fresh
        last_kill = max(p.killed_at or 0.0 for p in lf.by)
        after = sorted((s for s in submitted.get(r, []) if s[0] > last_kill), key=lambda s: s[0])
        if not after:
            unresolved += lf.fresh
            continue
        e = after[0][2]
        prev = per_lease.get(id(e), (e, 0))
        per_lease[id(e)] = (e, prev[1] + lf.fresh)
    for e, fresh in per_lease.values():
        rep = e["replayed_turns"]
        lost += max(0, fresh - rep)
        over += max(0, rep - fresh)
        carried += min(fresh, rep)
    inflight = 0
    for p in killed:
        for r in left_by_kill[p.label]:
            inflight += len(_interrupted(procs, p, r))
    kills = len(killed)
    return {
        "kills": kills,
        "turns_made_by_killed": made_total,
        "turns_carried": carried,
        "lost_turns": lost,
        "unresolved_turns": unresolved,
        "carried_without_line": over,
        "lost_turns_per_kill": round(lost / kills, 3) if kills else None,
        "inflight_episodes": inflight,
        "inflight_episodes_per_kill": round(inflight / kills, 3) if kills else None,
        "exact": all(len(e["rollouts"]) == 1 for e, _ in per_lease.values()),
    }


def _interrupted(procs: list[Proc], killed: Proc, r: str) -> set[int]:
    """The samples of rollout ``r`` its next holder after ``killed`` generated turns for."""
    at = killed.killed_at or 0.0
    firsts = []
    for q in procs:
        if q is killed:
            continue
        ts = [e["t"] for e in of(q.events, "turn") if e["rollout"] == r and e["t"] > at]
        ts += [e["t"] for e in of(q.events, "rollout") if r in e["rollouts"] and e["t"] > at]
        if ts:
            firsts.append((min(ts), q))
    if not firsts:
        return set()
    nxt = min(firsts, key=lambda x: x[0])[1]
    return {e["sample"] for e in of(nxt.events, "turn") if e["rollout"] == r and e["t"] > at}

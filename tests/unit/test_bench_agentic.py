"""The pure part of bench/agentic.py (bench/agentic_count.py): rollout replicas' JSON
lines to turns per second, turns lost per kill and turns aborted per weight update.
No job runs here."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("agentic_count", ROOT / "bench" / "agentic_count.py")
assert _spec is not None and _spec.loader is not None
ac = importlib.util.module_from_spec(_spec)
sys.modules["agentic_count"] = ac  # dataclasses resolve the module's annotations through it
_spec.loader.exec_module(ac)


def turn(rollout: str, sample: int, t: float, versions: tuple[int, ...] = (0,)) -> dict:
    return {
        "event": "turn",
        "rollout": rollout,
        "sample": sample,
        "tokens": 10,
        "t": t,
        "versions": list(versions),
    }


def rollout(ids: list[str], t: float, gen_s: float, turns: int, replayed: int = 0) -> dict:
    return {
        "event": "rollout",
        "rollouts": ids,
        "t": t,
        "gen_s": gen_s,
        "turns": turns,
        "replayed_turns": replayed,
    }


def test_throughput_counts_turn_lines_over_the_generation_window():
    a = ac.Proc(
        "rollout-0.0", [turn("p0.0", 0, 1.0), turn("p0.0", 1, 1.5), rollout(["p0.0"], 2.0, 1.5, 2)]
    )
    # b's last turn comes after the last submission (a lease never submitted): left out.
    b = ac.Proc(
        "rollout-1.0", [turn("p1.0", 0, 1.8), rollout(["p1.0"], 2.5, 1.0, 1), turn("p2.0", 0, 3.0)]
    )
    got = ac.throughput([a, b])
    assert got["turns"] == 3 and got["gen_wall_s"] == 2.0  # from 0.5 (2.0 - 1.5) to 2.5
    assert got["turns_per_s"] == 1.5 and got["leases"] == 2 and got["turns_per_lease"] == 1.5


def test_a_turn_is_lost_when_neither_submitted_nor_replayed():
    # rollout-0 submitted p0 itself, then was killed with two turns of p1 (samples 0, 1)
    # and one of p2 reported. The rescuer replays both of p1's (then generates sample
    # 1's next turn) and none of p2's: p2's turn is lost.
    killed = ac.Proc(
        "rollout-0.0",
        [
            turn("p0.0", 0, 1.0),
            rollout(["p0.0"], 2.0, 1.0, 1),
            turn("p1.0", 0, 3.0),
            turn("p1.0", 1, 3.1),
            turn("p2.0", 0, 3.2),
        ],
        killed_at=4.0,
    )
    rescuer = ac.Proc(
        "rollout-1.0",
        [
            turn("p1.0", 1, 6.0),
            rollout(["p1.0"], 7.0, 2.0, 3, replayed=2),
            rollout(["p2.0"], 9.0, 2.0, 0, replayed=0),
        ],
    )
    got = ac.lost_turns([killed, rescuer])
    assert got["kills"] == 1 and got["turns_made_by_killed"] == 3
    assert (
        got["turns_carried"] == 2 and got["lost_turns"] == 1 and got["lost_turns_per_kill"] == 1.0
    )
    assert got["inflight_episodes"] == 1  # sample 1 of p1 went on at the rescuer
    assert got["unresolved_turns"] == 0 and got["exact"]


def test_turns_carried_through_two_kills_and_unresolved_ones():
    first = ac.Proc("rollout-0.0", [turn("p1.0", 0, 1.0)], killed_at=2.0)
    # The second holder replays p1's turn, adds one, and dies too; p3 is never submitted.
    second = ac.Proc("rollout-1.0", [turn("p1.0", 0, 3.0), turn("p3.0", 0, 3.5)], killed_at=4.0)
    last = ac.Proc("rollout-0.1", [rollout(["p1.0"], 6.0, 1.0, 2, replayed=2)])
    got = ac.lost_turns([first, second, last])
    assert got["kills"] == 2 and got["turns_carried"] == 2 and got["lost_turns"] == 0
    assert got["unresolved_turns"] == 1
    # first's next holder (second) went on with sample 0; second's (last) generated none.
    assert got["inflight_episodes"] == 1 and got["inflight_episodes_per_kill"] == 0.5


def test_aborted_turns_per_inflight_update():
    p = ac.Proc(
        "rollout-0.0",
        [
            {"event": "sync", "inflight": True, "ok": True},
            {"event": "sync", "inflight": False, "ok": True},
            {"event": "sync", "inflight": True, "ok": False},
            {"event": "abandoned", "rollouts": ["p0.0", "p1.0"]},
            {"event": "sync", "inflight": True, "ok": True},
            turn("p2.0", 0, 1.0, versions=(1, 2)),
            turn("p2.0", 1, 1.0, versions=(2,)),
        ],
    )
    got = ac.aborted([p], group_size=4)
    assert got["aborted_turns"] == 8 and got["inflight_updates"] == 2
    assert got["aborted_turns_per_update"] == 4.0 and got["failed_updates"] == 1
    assert got["turns_across_versions"] == 1
    assert ac.aborted([], group_size=4)["aborted_turns_per_update"] is None

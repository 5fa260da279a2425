"""The controller's rollout queues as pure state (controller/queue_book.py): no
server, an injected clock, and a dict standing in for the journal, so a restart
is a restore from the changes written so far."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx.controller.queue_book import MAX_QUEUES, RolloutQueues
from phalanx.controller.tick import StateError

Tables = dict[str, dict[str, dict[str, Any]]]


class Journal:
    def __init__(self) -> None:
        self.tables: Tables = {}

    def put(self, table: str, key: str, rec: dict[str, Any] | None) -> None:
        if rec is None:
            self.tables.get(table, {}).pop(key, None)
        else:
            self.tables.setdefault(table, {})[key] = rec

    def restart(self, now: float) -> RolloutQueues:
        qs = RolloutQueues(self.put)
        qs.restore(self.tables, now)
        return qs


def rolls(*ids: str) -> list[dict[str, Any]]:
    return [{"rollout_id": r, "reward": 1.0} for r in ids]


def lease(qs: RolloutQueues, n: int, now: float, who: str = "c", lease_s: float = 10.0):
    return qs.lease("q", who, n, lease_s, now=now, wall=1000.0 + now)[0]["deliveries"]


def refs(ds: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(d["rollout_id"], d["attempt"]) for d in ds]


def settle(qs: RolloutQueues, ds, how: str, reason: str = "") -> int:
    return qs.settle("q", refs(ds), how, reason, now=0.0, wall=0.0)[0]["settled"]


def test_put_deduplicates_and_wakes_lease_waiters():
    j = Journal()
    qs = RolloutQueues(j.put)
    out, tick = qs.put("q", rolls("a", "b", "a"), now=0.0, wall=0.0)
    assert out == {"queued": ["a", "b"], "duplicates": 1} and tick.queues == {"q"}
    out, tick = qs.put("q", rolls("b"), now=0.0, wall=0.0)
    assert out == {"queued": [], "duplicates": 1} and not tick.queues


def test_expired_leases_go_first_and_a_stale_nack_changes_nothing():
    qs = RolloutQueues(Journal().put)
    qs.put("q", rolls("a", "b", "c"), now=0.0, wall=0.0)
    first = lease(qs, 1, now=0.0, who="dead")
    assert [d["rollout_id"] for d in first] == ["a"] and first[0]["deadline"] == 1010.0
    again = lease(qs, 2, now=11.0, who="live")  # a's lease expired: it comes first
    assert refs(again) == [("a", 2), ("b", 1)]
    assert settle(qs, first, "nack") == 0  # attempt 1 is no longer held
    assert refs(lease(qs, 5, now=12.0)) == [("c", 1)]
    assert settle(qs, first, "ack") == 1  # but a late ack of it settles a for good
    assert settle(qs, again, "ack") == 1  # b; a was settled already
    assert qs.status("q")["pending"] == 1  # c, leased


def test_restart_keeps_queued_leased_and_settled_and_quarantines_damage():
    j = Journal()
    qs = RolloutQueues(j.put)
    qs.put("q", rolls("a", "b", "c", "d"), now=0.0, wall=0.0)
    held = lease(qs, 2, now=0.0)
    settle(qs, held[:1], "discard", "stale")
    j.tables["rq_items"]["q/c"]["rollout"]["reward"] = 2.0  # damaged after its crc
    j.tables["rq_items"]["q/e"] = {"unreadable": '{"q": "q", "id": "e"'}
    qs = j.restart(now=100.0)
    assert qs.status("q") == {
        "pending": 2,
        "leased": 1,
        "put": 4,
        "acked": 0,
        "duplicates": 0,
        "corrupt": 2,
        "discarded": {"stale": 1},
    }
    # b is still held, under a fresh deadline (100 + its lease_s of 10).
    assert refs(lease(qs, 5, now=100.0, lease_s=30.0)) == [("d", 1)]
    assert refs(lease(qs, 5, now=110.0)) == [("b", 2)]
    assert qs.put("q", rolls("a", "c"), now=0.0, wall=0.0)[0]["queued"] == ["c"]
    assert "q/c" in j.tables["rq_quarantine"] and "q/e" in j.tables["rq_quarantine"]


def test_a_lease_creates_no_queue_and_the_number_of_queues_is_bounded():
    qs = RolloutQueues(Journal().put)
    assert lease(qs, 1, now=0.0) == [] and qs.books == {}
    for i in range(MAX_QUEUES):
        qs.put(f"q{i}", rolls("a"), now=0.0, wall=0.0)
    with pytest.raises(StateError, match="at most 64"):
        qs.put("one-more", rolls("a"), now=0.0, wall=0.0)


def test_records_of_journals_written_with_the_old_encoder_still_check():
    """The crc is taken over the journal's compact JSON. That encoder changed (the
    standard library's to pydantic-core's, which spell some floats differently:
    1e-05 vs 0.00001); a record whose crc the old one computed still restores."""
    import json
    import zlib

    from phalanx.controller.journal import encode

    odd = {"rollout_id": "a", "logprobs": [1e-05, -2.5e-07, 1e22, -0.0]}
    assert json.loads(encode(odd)) == odd  # the same values, spelled another way
    assert encode(odd) != json.dumps(odd, separators=(",", ":"))
    j = Journal()
    RolloutQueues(j.put).put("q", [odd], now=0.0, wall=0.0)
    rec = j.tables["rq_items"]["q/a"]
    rec["crc"] = zlib.crc32(json.dumps(odd, separators=(",", ":")).encode())  # as before
    qs = j.restart(now=1.0)
    assert qs.status("q")["corrupt"] == 0
    assert [d["rollout"] for d in lease(qs, 1, now=1.0)] == [odd]

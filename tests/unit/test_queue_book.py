"""The controller's rollout queues as pure state (controller/core/queues.py): no
server, an injected clock, a dict standing in for the journal and another for
the payload log, so a restart is a restore from what was written so far."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx.controller.core.base import ChangeLog, StateError, Tick
from phalanx.controller.core.queues import MAX_QUEUES, RolloutQueues

Tables = dict[str, dict[str, dict[str, Any]]]


class Journal:
    """The journal and the payload log of a controller, as dicts, written as the
    service writes them: a call's payloads, then its changes, then its drops."""

    def __init__(self) -> None:
        self.tables: Tables = {}
        self.payloads: dict[str, Any] = {}
        self.log = ChangeLog(history=100)

    def commit(self, tick: Tick | None = None) -> None:
        if tick is not None:
            self.payloads.update(tick.puts)
        for table, key, rec in self.log.drain():
            if rec is None:
                self.tables.get(table, {}).pop(key, None)
            else:
                self.tables.setdefault(table, {})[key] = rec
        if tick is not None:
            for key in tick.drops:
                self.payloads.pop(key, None)

    def queues(self) -> RolloutQueues:
        return Queues(self, RolloutQueues(self.log, self.payloads.get))

    def restart(self, now: float) -> RolloutQueues:
        self.log = ChangeLog(history=100)
        qs = RolloutQueues(self.log, self.payloads.get)
        self.payloads.update(qs.restore(self.tables, now))
        self.commit()
        return Queues(self, qs)


class Queues:
    """A RolloutQueues whose every call is committed to its Journal."""

    def __init__(self, journal: Journal, qs: RolloutQueues):
        self.journal, self.qs = journal, qs

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.qs, name)
        if name not in ("put", "lease", "settle"):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            out, tick = attr(*args, **kwargs)
            self.journal.commit(tick)
            return out, tick

        return call


def rolls(*ids: str) -> list[dict[str, Any]]:
    return [{"rollout_id": r, "reward": 1.0} for r in ids]


def lease(qs: Any, n: int, now: float, who: str = "c", lease_s: float = 10.0):
    return qs.lease("q", who, n, lease_s, now=now, wall=1000.0 + now)[0]


def refs(ds: list[Any]) -> list[tuple[str, int]]:
    return [(d.rollout_id, d.attempt) for d in ds]


def settle(qs: Any, ds, how: str, reason: str = "") -> int:
    return qs.settle("q", refs(ds), how, reason, now=0.0, wall=0.0)[0]


def test_put_deduplicates_and_wakes_lease_waiters():
    j = Journal()
    qs = j.queues()
    out, tick = qs.put("q", rolls("a", "b", "a"), now=0.0, wall=0.0)
    assert out == (["a", "b"], 1) and tick.queues == {"q"}
    out, tick = qs.put("q", rolls("b"), now=0.0, wall=0.0)
    assert out == ([], 1) and not tick.queues
    # The payloads went to the payload log, not the journal.
    assert set(j.payloads) == {"q/q/a", "q/q/b"}
    assert all("rollout" not in rec for rec in j.tables["rq_items"].values())


def test_expired_leases_go_first_and_a_stale_nack_changes_nothing():
    qs = Journal().queues()
    qs.put("q", rolls("a", "b", "c"), now=0.0, wall=0.0)
    first = lease(qs, 1, now=0.0, who="dead")
    assert [d.rollout_id for d in first] == ["a"] and first[0].deadline == 1010.0
    again = lease(qs, 2, now=11.0, who="live")  # a's lease expired: it comes first
    assert refs(again) == [("a", 2), ("b", 1)]
    assert settle(qs, first, "nack") == 0  # attempt 1 is no longer held
    assert refs(lease(qs, 5, now=12.0)) == [("c", 1)]
    assert settle(qs, first, "ack") == 1  # but a late ack of it settles a for good
    assert settle(qs, again, "ack") == 1  # b; a was settled already
    assert qs.status("q")["pending"] == 1  # c, leased


def test_restart_keeps_queued_leased_and_settled_and_quarantines_damage():
    j = Journal()
    qs = j.queues()
    qs.put("q", rolls("a", "b", "c", "d"), now=0.0, wall=0.0)
    held = lease(qs, 2, now=0.0)
    settle(qs, held[:1], "discard", "stale")
    assert "q/q/a" not in j.payloads  # a settled rollout's payload is dropped
    j.payloads["q/q/c"] = {**j.payloads["q/q/c"], "reward": 2.0}  # damaged after its crc
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
    assert qs.put("q", rolls("a", "c"), now=0.0, wall=0.0)[0][0] == ["c"]
    assert "q/c" in j.tables["rq_quarantine"] and "q/e" in j.tables["rq_quarantine"]


def test_a_lease_creates_no_queue_and_the_number_of_queues_is_bounded():
    qs = Journal().queues()
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
    j.queues().put("q", [odd], now=0.0, wall=0.0)
    rec = j.tables["rq_items"]["q/a"]
    rec["crc"] = zlib.crc32(json.dumps(odd, separators=(",", ":")).encode())  # as before
    qs = j.restart(now=1.0)
    assert qs.status("q")["corrupt"] == 0
    assert [d.rollout for d in lease(qs, 1, now=1.0)] == [odd]


def test_a_journal_written_before_the_payload_log_moves_its_rollouts_out():
    """Queue records that still hold their rollout (a journal from before the payload
    log) restore as before; the rollout moves to the payload log and the record is
    rewritten without it."""
    from phalanx.controller.core.queues import checksum

    j = Journal()
    r = {"rollout_id": "a", "reward": 1.0}
    j.tables = {
        "rq_items": {"q/a": {"q": "q", "id": "a", "seq": 1, "crc": checksum(r), "rollout": r}},
        "rq_meta": {"q": {"seq": 1, "counts": {"put": 1}}},
    }
    qs = j.restart(now=0.0)
    assert j.payloads == {"q/q/a": r}
    assert "rollout" not in j.tables["rq_items"]["q/a"]
    assert [d.rollout for d in lease(qs, 1, now=0.0)] == [r]
    assert qs.status("q")["corrupt"] == 0

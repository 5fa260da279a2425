"""A weight source's sends (:class:`phalanx.transport.base.Sends`): one at a time, and
an order that a newer one superseded before its send began is reported failed at once,
not sent. A restarted controller hands the source a new order while its last send still
runs; before this, each restart queued one more send, each waited out receivers that
had moved on, and the source fell ever further behind (a chaos run with a controller
killed every 3 s stopped syncing for good)."""

from __future__ import annotations

import threading

from phalanx.transport.base import Sends, SyncOrder, SyncResult


def order(seq: int) -> SyncOrder:
    return SyncOrder(seq=seq, mesh_id=seq, members=("policy-0", "rollout-0"), rank=0, store="h:1")


def test_orders_superseded_while_a_send_runs_are_reported_not_sent():
    sends, release = Sends("test-sends"), threading.Event()
    sent: list[int] = []
    reports: list[SyncResult] = []

    def send(seq: int) -> SyncResult:
        if seq == 1:
            assert release.wait(30)
        sent.append(seq)
        res = SyncResult(seq, 10 + seq, True, 0.0, 8, 2)
        reports.append(res)
        return res

    try:
        futures = [
            sends.submit(order(s), 10 + s, lambda s=s: send(s), reports.append)
            for s in (1, 2, 3, 4)
        ]
        release.set()
        results = [f.result(timeout=30) for f in futures]
    finally:
        sends.shutdown()
    assert sent == [1, 4]  # the running one, then only the newest
    assert [(r.seq, r.ok) for r in results] == [(1, True), (2, False), (3, False), (4, True)]
    assert sorted(r.seq for r in reports) == [1, 2, 3, 4]  # each reported once
    skipped = results[1]
    assert skipped.error == "sync 2 was superseded by sync 4 before it began: not sent"
    assert (skipped.version, skipped.members, skipped.nbytes) == (12, 2, 0)


def test_an_order_handed_when_the_source_is_free_is_sent():
    sends = Sends("test-sends")
    try:
        for s in (5, 6):
            res = sends.submit(
                order(s), s, lambda s=s: SyncResult(s, s, True, 0.0, 1, 2), lambda r: None
            ).result(timeout=30)
            assert res.ok and res.seq == s
    finally:
        sends.shutdown()

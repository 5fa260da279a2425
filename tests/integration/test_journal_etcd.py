"""The etcd journal against a real etcd: it loads what the SQLite journal loads for the
same writes, a tick too large for one transaction stays atomic, a deposed leader
writes nothing, and bad input is refused in one line."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from etcd_server import ETCD, MISSING, etcd, start_cluster  # noqa: F401  (etcd: a module-scoped fixture)

from phalanx.config import JobConfig
from phalanx.config.journal import parse_etcd
from phalanx.controller.journal import Deposed, JournalUnavailable, SqliteJournal
from phalanx.controller.journal.etcd import MAX_BYTES, MAX_OPS, TIMEOUT_S, EtcdJournal
from phalanx.controller.journal.etcd_kv import EtcdKV, delete_prefix, put
from phalanx.controller.payloads import PayloadLog
from phalanx.controller.service import ControllerService
from phalanx.controller.statedir import CannotStart
from phalanx.net import free_port


def open_journal(
    url: str, job: str = "job", me: str = "http://127.0.0.1:1", **kw: Any
) -> EtcdJournal:
    return EtcdJournal(parse_etcd(url), job, me, **kw)


def prefix() -> str:
    return f"/t{uuid.uuid4().hex[:10]}"


def batches() -> list[list[tuple[str, str, dict[str, Any] | None]]]:
    """A few ticks of rows: puts, overwrites, a delete, a key written twice in one tick,
    and one tick of 300 rows and 2 MB (over etcd's 128 ops and 1.5 MiB)."""
    big = [("ledger", f"r{i:04d}", {"i": i, "pad": "x" * 7000}) for i in range(300)]
    return [
        [("meta", "epoch", {"value": 1}), ("members", "a:1", {"step": 0, "name": "a"})],
        [
            ("members", "a:1", {"step": 1}),
            ("members", "a:1", {"step": 2}),
            ("events", "1", {"k": "q"}),
        ],
        big,
        [("ledger", "r0001", None), ("members", "b:2", {"step": 2, "odd": 'ü/é"x'})],
        [("events", "1", None), ("meta", "epoch", {"value": 2})],
    ]


def test_it_loads_what_the_sqlite_journal_loads_for_the_same_writes(etcd, tmp_path: Path):  # noqa: F811
    lite = SqliteJournal(tmp_path / "j.sqlite")
    j = open_journal(etcd.url(prefix()))
    for b in batches():
        lite.write(b)
        j.write(b)
    assert sum(len(b) for b in batches()[2:3]) > 128
    assert len(json.dumps(batches()[2])) > 1.5 * 2**20
    assert j.load() == lite.load()
    assert j.writes == lite.writes == 5
    j.close()
    again = open_journal(j.where)  # a restart: the leader key went with close()
    assert again.load() == lite.load()
    assert again.term == 2, "each controller that takes office starts a term"
    again.close()
    lite.close()


def test_a_large_tick_is_atomic_whatever_step_its_writer_died_at(etcd):  # noqa: F811
    url = etcd.url(prefix())
    j = open_journal(url)
    j.write([("members", "a:1", {"step": 1}), ("ledger", "r0", {"old": True})])
    rows = [["ledger", f"r{i}", {"i": i, "pad": "y" * 9000}] for i in range(MAX_OPS * 3)]
    data = json.dumps(rows).encode()
    parts = [data[i : i + MAX_BYTES] for i in range(0, len(data), MAX_BYTES)]
    assert len(parts) > 1
    kv = EtcdKV(parse_etcd(url), TIMEOUT_S)
    fence = j.leader.fence()

    def stage(bid: str) -> None:
        for i, part in enumerate(parts):
            kv.txn([fence], [put(f"{j.stage_prefix}{bid}/{i:06d}", part)], [])

    # Died after staging, before the commit: none of it is there.
    stage("dead")
    j.close()
    k = open_journal(url)
    assert k.load() == {"members": {"a:1": {"step": 1}}, "ledger": {"r0": {"old": True}}}
    k.write([("members", "a:1", {"step": 2})])  # settles first: the stray parts go
    assert kv.range_prefix(k.stage_prefix) == []

    # Died half way through folding a committed batch: all of it is there, and the next
    # write finishes the fold before its own rows.
    fence = k.leader.fence()
    stage("live")
    kv.txn(
        [fence], [put(k.commit_key, json.dumps({"id": "live", "parts": len(parts)}).encode())], []
    )
    half = [put(f"{k.rec_prefix}ledger/r{i}", json.dumps(rows[i][2]).encode()) for i in range(50)]
    kv.txn([fence], half, [])
    k.close()
    m = open_journal(url)
    want = {"members": {"a:1": {"step": 2}}, "ledger": {"r0": {"i": 0, "pad": "y" * 9000}}}
    want["ledger"].update({f"r{i}": {"i": i, "pad": "y" * 9000} for i in range(MAX_OPS * 3)})
    assert m.load() == want
    m.write([("ledger", "r5", None)])
    assert kv.get(m.commit_key) is None and kv.range_prefix(m.stage_prefix) == []
    m.close()
    del want["ledger"]["r5"]
    n = open_journal(url)
    assert n.load() == want
    n.close()


def test_a_deposed_leader_never_writes_again(etcd):  # noqa: F811
    url = etcd.url(prefix())
    first = open_journal(url, me="http://first:1")
    first.write([("members", "a:1", {"step": 1})])
    kv = EtcdKV(parse_etcd(url), TIMEOUT_S)
    kv.revoke(first.leader.lease)  # as when it was stopped past its lease's TTL
    second = open_journal(url, me="http://second:2")
    assert second.term == 2
    with pytest.raises(Deposed) as e:
        first.write([("members", "a:1", {"step": 99}), ("members", "z:9", {"step": 0})])
    assert "no longer leads job 'job'" in str(e.value) and "http://second:2" in str(e.value)
    assert "term 2" in str(e.value), str(e.value)
    assert second.load() == {"members": {"a:1": {"step": 1}}}, "nothing of it landed"
    # Every later write is refused at once, even one etcd would have fenced anyway.
    with pytest.raises(Deposed):
        first.write([("members", "a:1", {"step": 100})])
    second.write([("members", "a:1", {"step": 2})])
    assert second.load() == {"members": {"a:1": {"step": 2}}}
    first.close()  # does not revoke the new leader's key
    assert kv.get(second.leader.leader_key) is not None
    second.close()


def test_a_lapsed_lease_nobody_took_is_taken_again_in_the_same_term(etcd):  # noqa: F811
    url = etcd.url(prefix())
    j = open_journal(url)
    kv = EtcdKV(parse_etcd(url), TIMEOUT_S)
    kv.revoke(j.leader.lease)  # etcd expired it (it was paused past the TTL)
    j.write([("members", "a:1", {"step": 1})])
    assert j.term == 1 and j.load() == {"members": {"a:1": {"step": 1}}}
    leader = json.loads(kv.get(j.leader.leader_key)["value"])
    assert leader["url"] == "http://127.0.0.1:1" and leader["term"] == 1
    j.close()


def test_a_second_controller_of_a_running_job_is_refused_in_one_line(etcd):  # noqa: F811
    url = etcd.url(prefix())
    j = open_journal(url, me="http://live:7")
    with pytest.raises(CannotStart) as e:
        open_journal(url, me="http://other:8", take_wait_s=0.3)
    msg = str(e.value)
    assert "job 'job' must have one leader: the controller at http://live:7 (term 1" in msg, msg
    assert "\n" not in msg
    j.close()
    open_journal(url).close()  # its key went with close(): the next one starts at once


def test_two_jobs_on_one_prefix_are_refused_in_one_line(etcd):  # noqa: F811
    url = etcd.url(prefix())
    open_journal(url, job="job-a").close()
    with pytest.raises(CannotStart) as e:
        open_journal(url, job="job-b")
    msg = str(e.value)
    assert "must hold one job: it holds job 'job-a', and this is job 'job-b'" in msg, msg
    assert "\n" not in msg
    # Without a prefix in the URL each job gets its own: both start.
    plain = etcd.url()
    a, b = open_journal(plain, job="job-a"), open_journal(plain, job="job-b")
    assert (a.prefix, b.prefix) == ("/phalanx/job-a", "/phalanx/job-b")
    a.close()
    b.close()
    EtcdKV(parse_etcd(plain), TIMEOUT_S).txn([], [delete_prefix("/phalanx/")], [])


def test_an_etcd_that_does_not_answer_is_refused_in_one_line():
    url = f"etcd://127.0.0.1:{free_port()}/p"
    t0 = time.monotonic()
    with pytest.raises(CannotStart) as e:
        open_journal(url)
    msg = str(e.value)
    assert msg.startswith(
        f"controller.journal {url} must name an etcd that answers: etcd at 127.0.0.1:"
    )
    assert "\n" not in msg and time.monotonic() - t0 < 2 * TIMEOUT_S


def test_a_stopped_etcd_makes_writes_unavailable_until_it_runs_again(etcd):  # noqa: F811
    j = open_journal(etcd.url(prefix()))
    j.write([("members", "a:1", {"step": 1})])
    etcd.member.signal(signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(JournalUnavailable) as e:
            j.write([("members", "a:1", {"step": 2})])
        assert f"did not answer within {TIMEOUT_S:g} s" in str(e.value)
        assert time.monotonic() - t0 < 2 * TIMEOUT_S
    finally:
        etcd.member.signal(signal.SIGCONT)
    j.write([("members", "a:1", {"step": 2})])  # the same batch again: it lands
    assert j.load() == {"members": {"a:1": {"step": 2}}}
    j.close()


def write_until_it_lands(j: EtcdJournal, batch: list[tuple[str, str, Any]]) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            return j.write(batch)
        except JournalUnavailable:
            assert time.monotonic() < deadline, "the cluster never answered again"
            time.sleep(0.05)  # a backoff between tries, as the outbox's


def test_a_cluster_that_loses_its_quorum_stalls_writes_and_loses_nothing(tmp_path: Path):
    if ETCD is None:
        pytest.skip(MISSING)
    cluster = start_cluster(tmp_path / "etcd", 3)
    try:
        j = open_journal(cluster.url(prefix()))
        j.write([("members", "a:1", {"step": 1})])
        # One member gone for good (the one this journal talks to): the others answer,
        # once they have elected a leader if it was theirs.
        cluster.members[0].stop()
        write_until_it_lands(j, [("members", "a:1", {"step": 2})])
        # A second one stopped: no quorum, nothing commits, and the write says so.
        cluster.members[1].signal(signal.SIGSTOP)
        with pytest.raises(JournalUnavailable):
            j.write([("members", "a:1", {"step": 3})])
        cluster.members[1].signal(signal.SIGCONT)
        write_until_it_lands(j, [("members", "a:1", {"step": 3})])  # as the outbox does
        assert j.load() == {"members": {"a:1": {"step": 3}}}
        j.close()
    finally:
        cluster.stop()


def test_concurrent_calls_share_transactions_and_replies_wait_for_them(etcd, tmp_path: Path):  # noqa: F811
    url = etcd.url(prefix())
    svc = ControllerService(JobConfig(), open_journal(url), PayloadLog(tmp_path / "p"))
    start = svc.journal.writes

    async def register(i: int) -> tuple[int, int]:
        svc.apply(svc.state.register, "policy", f"r{i}", "i0")
        made = svc.outbox.made
        await svc.acknowledged()
        return made, svc.outbox.durable  # what was durable when this reply could go

    async def run() -> list[tuple[int, int]]:
        done = await asyncio.gather(*(register(i) for i in range(50)))
        await svc.outbox.stop()
        return list(done)

    replies = asyncio.run(run())
    writes = svc.journal.writes - start
    assert all(durable >= made for made, durable in replies), "each reply after its batch"
    assert 1 <= writes < 50, f"{writes} transactions for 50 calls"
    svc.journal.close()
    again = open_journal(url)
    assert len(again.load()["members"]) == 50
    again.close()

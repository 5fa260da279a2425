"""The rollout-queue contract, run against every backend: the controller's own
queue (a real ``phalanx controller`` process on port 0, shared by the module,
each test on a queue of its own), Redis Streams (a real ``redis-server``), the
storage spool on ``file://``, on ``memory://`` and on ``s3://`` (a real local
S3-compatible server: moto's, reached through s3fs as a job reaches S3).

Ordering is not part of the contract. What is: no loss; no delivery of an id
after it was acked; redelivery after a lease expires (and after a nack); a
consumer killed between its lease and its ack loses nothing; a corrupt record
is quarantined and counted, never raised; producers and consumers in separate
processes together consume every rollout exactly once (one ack of it counts), even
when a consumer slower than its lease shares a rollout with another.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import struct
import subprocess
import sys
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from procs import Controller, Procs, child_env, wait_for, write_job_toml
from redis_server import redis_url  # noqa: F401  (a pytest fixture)
from s3 import S3Root, s3_server  # noqa: F401  (a pytest fixture)

from phalanx.console.view import status_text
from phalanx.protocol.status import Status
from phalanx.transport.base import Delivery, RolloutQueue, TransportError
from phalanx.transport.controller_queue import ControllerRolloutQueue
from phalanx.transport.redis_queue import RedisRolloutQueue
from phalanx.transport.spool import MAGIC, SpoolRolloutQueue, encode

WORKER = Path(__file__).with_name("queue_worker.py")
BACKENDS = ["controller", "redis", "file", "memory", "s3"]
CROSS_PROCESS = [
    "controller",
    "redis",
    "file",
    "s3",
    pytest.param(
        "memory",
        marks=pytest.mark.skip(reason="memory:// lives in one process: no other can reach it"),
    ),
]


class Backend:
    def __init__(
        self,
        kind: str,
        url: str,
        name: str,
        ctl: Controller | None = None,
        options: dict[str, Any] | None = None,
    ):
        self.kind, self.url, self.name, self.ctl = kind, url, name, ctl
        self.options = options or {}
        """fsspec storage options (the S3 endpoint and credentials)."""

    def make(self, consumer: str = "c0", lease_s: float = 30.0) -> RolloutQueue:
        if self.kind == "controller":
            return ControllerRolloutQueue(self.url, self.name, consumer, lease_s=lease_s)
        if self.kind == "redis":
            return RedisRolloutQueue(self.url, self.name, consumer, lease_s=lease_s)
        return SpoolRolloutQueue(
            self.url, consumer, lease_s=lease_s, poll_s=0.01, storage_options=self.options
        )

    def spec(self, lease_s: float) -> str:
        kind = self.kind if self.kind in ("controller", "redis") else "spool"
        return json.dumps(
            {
                "kind": kind,
                "url": self.url,
                "name": self.name,
                "lease_s": lease_s,
                "options": self.options,
            }
        )


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Controller]:
    """One controller process for the module (each test uses a queue of its own);
    a test may kill and restart it on its state dir."""
    work = tmp_path_factory.mktemp("queue-controller")
    procs = Procs(work)
    config = write_job_toml(
        work / "job.toml",
        {
            "job": {"id": "queue-contract"},
            "controller": {"tick_s": 0.05},
            "roles.policy": {"min_replicas": 1},
        },
    )
    try:
        yield Controller(procs, work / "state", config).start()
    finally:
        procs.cleanup()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    name = f"t-{uuid.uuid4().hex[:10]}"
    if request.param == "controller":
        ctl: Controller = request.getfixturevalue("controller")
        # Named by its state dir: a client re-reads the URL there if it restarts.
        return Backend("controller", str(ctl.state_dir), name, ctl=ctl)
    if request.param == "redis":
        return Backend("redis", request.getfixturevalue("redis_url"), name)
    if request.param == "file":
        return Backend("file", f"file://{tmp_path}/spool", name)
    if request.param == "s3":
        root: S3Root = request.getfixturevalue("s3_server")
        url, options = root.sub(name)
        return Backend("s3", url, name, options=options)
    return Backend("memory", f"memory://{name}/spool", name)


@pytest.fixture
def backend_controller(controller: Controller) -> Backend:
    """The controller backend alone, for the cases only it has (a restart, its API)."""
    name = f"t-{uuid.uuid4().hex[:10]}"
    return Backend("controller", str(controller.state_dir), name, ctl=controller)


def rollouts(ids: list[str]) -> list[dict[str, Any]]:
    return [{"rollout_id": r, "version": 1, "reward": 0.5, "completions": [[1, 2]]} for r in ids]


def drain(q: RolloutQueue, n: int = 10) -> list[str]:
    got: list[str] = []
    while ds := q.lease(n):
        got += [d.rollout_id for d in ds]
        q.ack(ds)
    return got


def test_no_loss_and_no_delivery_after_ack(backend: Backend):
    a, b = backend.make("a"), backend.make("b")
    ids = [f"p{i}.0" for i in range(40)]
    for k in range(0, 40, 8):
        a.put(rollouts(ids[k : k + 8]))
    assert a.pending() == 40
    seen: list[str] = []
    while True:  # two consumers in turn
        da, db = a.lease(3), b.lease(5)
        if not da and not db:
            break
        seen += [d.rollout_id for d in da + db]
        assert all(d.attempt == 1 for d in da + db)
        a.ack(da)
        b.ack(db)
    assert sorted(seen) == sorted(ids), "lost or duplicated"
    assert a.pending() == b.pending() == 0
    # A second put of acked ids is never delivered again.
    a.put(rollouts(ids[:5]))
    assert drain(b) == [] and drain(a) == []
    assert a.counts()["acked"] == 40


def test_duplicate_puts_are_delivered_once(backend: Backend):
    q = backend.make()
    first = q.put(rollouts(["p1.0", "p2.0"]))
    again = q.put(rollouts(["p2.0", "p3.0"]))
    assert first == ["p1.0", "p2.0"]
    if backend.kind in ("redis", "controller"):
        assert again == ["p3.0"]  # deduplicated at put
    assert sorted(drain(q)) == ["p1.0", "p2.0", "p3.0"]


def test_redelivery_after_lease_expiry_and_after_nack(backend: Backend):
    # Held leases are exclusive: with a lease far longer than any wait here (a loaded
    # machine, a slow S3), a second consumer gets none of them.
    a, b = backend.make("a", lease_s=60.0), backend.make("b", lease_s=60.0)
    a.put(rollouts([f"p{i}.0" for i in range(6)]))
    held = a.lease(4)
    assert len(held) == 4
    rest = b.lease(10)
    assert {d.rollout_id for d in rest}.isdisjoint({d.rollout_id for d in held})
    b.ack(rest)
    a.ack(held)
    # A consumer that dies holding short leases: once they expire, its rollouts go
    # to the next consumer that leases (waited for, however long that takes). The
    # expiry is the holder's: b's own 60 s lease does not delay the takeover.
    dead = backend.make("dead", lease_s=0.4)
    lost_ids = [f"p{i}.0" for i in range(6, 10)]
    dead.put(rollouts(lost_ids))
    lost = dead.lease(4)
    assert sorted(d.rollout_id for d in lost) == lost_ids
    again: list[Delivery] = []

    def all_again() -> bool:
        again.extend(b.lease(10))
        return {d.rollout_id for d in again} >= set(lost_ids)

    wait_for(all_again, 60, "expired leases to be delivered again")
    assert all(d.attempt >= 2 for d in again)
    b.ack(again)
    assert dead.ack(lost) == 0  # the late ack of a consumer whose lease expired: harmless
    assert a.pending() == 0 and drain(a) == []
    # A nack hands a rollout back without waiting for its deadline.
    a.put(rollouts(["p19.0"]))
    d = a.lease(1)
    a.nack(d)
    back = wait_for(lambda: b.lease(1), 60, "the nacked rollout")
    assert [x.rollout_id for x in back] == ["p19.0"]
    assert back[0].attempt == d[0].attempt + 1
    b.ack(back)


def test_a_stale_lease_settles_nothing_twice_and_never_takes_back(backend: Backend):
    # A consumer slower than its lease: its rollouts go to the next consumer once the
    # lease expires, and then both hold one. Exactly one ack of each is counted,
    # whichever comes first; a late nack does not take a rollout from its new holder.
    slow, b = backend.make("slow", lease_s=0.3), backend.make("b", lease_s=60.0)
    ids = ["p1.0", "p2.0", "p3.0"]
    slow.put(rollouts(ids))
    stale = {d.rollout_id: d for d in slow.lease(3)}
    assert sorted(stale) == ids
    again: dict[str, Delivery] = {}

    def all_again() -> bool:
        again.update((d.rollout_id, d) for d in b.lease(10))
        return set(again) == set(ids)

    wait_for(all_again, 60, "the expired leases to be delivered again")
    assert all(again[r].attempt > stale[r].attempt for r in ids)
    # The new holder acks first: the stale ack counts nothing.
    assert b.ack([again["p1.0"]]) == 1
    assert slow.ack([stale["p1.0"]]) == 0
    # The stale holder acks first: it counts, and the new holder's ack does not.
    assert slow.ack([stale["p2.0"]]) == 1
    assert b.ack([again["p2.0"]]) == 0
    # A stale nack leaves p3.0 with its new holder: nobody else gets it meanwhile.
    slow.nack([stale["p3.0"]])
    assert backend.make("c", lease_s=60.0).lease(10) == []
    assert b.ack([again["p3.0"]]) == 1
    assert b.pending() == 0 and b.counts()["acked"] == 3


def test_a_redis_entry_read_but_given_no_deadline_is_taken_over_once_idle(
    redis_url: str,  # noqa: F811  (the fixture)
):
    # A consumer killed between its XREADGROUP and the write of its deadline leaves
    # an entry pending with no deadline. The next consumer takes it over once it has
    # been idle past that consumer's own lease; before that, it stays with its holder.
    name = f"t-{uuid.uuid4().hex[:10]}"
    dead = RedisRolloutQueue(redis_url, name, "dead", lease_s=60.0)
    dead.put(rollouts(["p1.0", "p2.0"]))
    held = dead.lease(2)
    dead.r.zrem(dead.leases, *(d.receipt for d in held))  # as if killed before the write
    patient = RedisRolloutQueue(redis_url, name, "patient", lease_s=600.0)
    assert patient.lease(10) == []
    quick = RedisRolloutQueue(redis_url, name, "quick", lease_s=0.2)
    got = wait_for(lambda: quick.lease(10), 60, "the entries with no deadline")
    assert sorted(d.rollout_id for d in got) == ["p1.0", "p2.0"]
    assert all(d.attempt == 2 for d in got)
    assert dead.r.zcard(dead.leases) == 2  # taken over with a deadline of their own
    quick.ack(got)
    assert dead.r.zcard(dead.leases) == 0 and drain(dead) == []


def test_a_redis_ack_resent_after_its_reply_was_lost_still_counts(
    redis_url: str,  # noqa: F811  (the fixture)
    monkeypatch: pytest.MonkeyPatch,
):
    # redis-py sends a command again when its reply is lost (a timeout, a dropped
    # connection): the first send settled the rollout, and the second must still
    # learn that this ack counted, not that another consumer's did.
    q = RedisRolloutQueue(redis_url, f"t-{uuid.uuid4().hex[:10]}", "a")
    q.put(rollouts(["p1.0", "p2.0"]))
    ds = q.lease(2)
    evalsha = q.r.evalsha

    def reply_lost(*args: Any) -> Any:
        evalsha(*args)  # runs; its reply never arrives
        return evalsha(*args)

    monkeypatch.setattr(q.r, "evalsha", reply_lost)
    assert q.ack(ds[:1]) == 1
    assert q.discard(ds[1:], "stale") == 1
    assert q.ack(ds) == 0  # a new ack of them counts nothing
    monkeypatch.undo()
    assert q.counts()["acked"] == 1 and q.counts()["discarded"] == {"stale": 1}
    assert q.pending() == 0 and drain(q) == []


def test_discard_is_counted_with_its_reason(backend: Backend):
    q = backend.make()
    q.put(rollouts(["p1.0", "p2.0", "p3.0"]))
    ds = {d.rollout_id: d for d in q.lease(3)}
    q.discard([ds["p1.0"], ds["p2.0"]], "stale")
    q.ack([ds["p3.0"]])
    q.discard([ds["p1.0"]], "stale")  # idempotent
    c = q.counts()
    assert c["discarded"] == {"stale": 2} and c["acked"] == 1
    assert q.pending() == 0 and drain(q) == []


def _corrupt_journal(backend: Backend) -> int:
    """Damage the controller's journal while it is down: a queued record whose bytes
    changed (checksum mismatch), one that is not a rollout, one that is not even
    JSON. Restart it on the damaged journal. Returns how many are corrupt."""
    ctl = backend.ctl
    assert ctl is not None
    ctl.kill(signal.SIGKILL)
    good = {"rollout_id": "p100.0", "version": 1}
    crc = zlib.crc32(json.dumps(good, separators=(",", ":")).encode())
    flipped = {**good, "version": 7}  # the bytes changed after the checksum was taken
    rows = [
        (
            "p100.0",
            json.dumps(
                {"q": backend.name, "id": "p100.0", "seq": 90, "crc": crc, "rollout": flipped}
            ),
        ),
        (
            "p101.0",
            json.dumps({"q": backend.name, "id": "p101.0", "seq": 91, "crc": 0, "rollout": [1, 2]}),
        ),
        ("p102.0", '{"q": "' + backend.name + '", "id": "p102.0", "rollout": {"rollo'),
    ]
    db = sqlite3.connect(ctl.state_dir / "journal.sqlite")
    with db:
        db.executemany(
            "INSERT INTO records VALUES ('rq_items', ?, ?)",
            [(f"{backend.name}/{rid}", value) for rid, value in rows],
        )
    db.close()
    ctl.start()
    return len(rows)


def _corrupt(backend: Backend, q: RolloutQueue) -> int:
    """Inject corrupt records next to good ones; returns how many are corrupt."""
    if backend.kind == "controller":
        return _corrupt_journal(backend)
    if isinstance(q, RedisRolloutQueue):
        q.r.xadd(q.stream, {"id": "p100.0", "data": b'{"rollout_id":"p100.0"}', "crc": "1"})
        q.r.xadd(
            q.stream, {"id": "p101.0", "data": b"{not json", "crc": str(zlib.crc32(b"{not json"))}
        )
        return 2
    assert isinstance(q, SpoolRolloutQueue)
    good = encode(rollouts(["p50.0"])[0])
    flipped = bytearray(encode(rollouts(["p51.0"])[0]))
    flipped[-3] ^= 0xFF  # a bit flip in the payload: checksum mismatch
    truncated = encode(rollouts(["p52.0"])[0])[:-7]  # a torn tail
    bad_len = bytearray(encode(rollouts(["p53.0"])[0]))
    struct.pack_into("<I", bad_len, len(MAGIC), 1 << 30)  # a length past the end
    blob = bytes(flipped) + good + bytes(bad_len) + encode(rollouts(["p54.0"])[0]) + truncated
    q.fs.pipe_file(f"{q.root}/segments/00000000000000000001-hand-000001.seg", blob)
    return 3


def test_corrupt_records_are_quarantined_and_counted(backend: Backend):
    q = backend.make()
    q.put(rollouts(["p1.0", "p2.0"]))
    bad = _corrupt(backend, q)
    got = drain(q)  # never raises
    assert {"p1.0", "p2.0"} <= set(got)
    assert not {"p100.0", "p101.0", "p102.0", "p51.0", "p52.0", "p53.0"} & set(got)
    if backend.kind not in ("redis", "controller"):
        assert {"p50.0", "p54.0"} <= set(got)
    assert q.counts()["corrupt"] == bad
    assert q.pending() == 0


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )


def _lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in out.splitlines() if x.startswith("{")]


@pytest.mark.parametrize("backend", CROSS_PROCESS, indirect=True)
def test_consumer_killed_between_lease_and_ack_loses_nothing(backend: Backend):
    lease_s = 3.0
    q = backend.make("survivor", lease_s=lease_s)
    q.put(rollouts([f"p{i}.0" for i in range(10)]))
    p = _spawn("crash", backend.spec(lease_s), "6")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 9, err
    line = _lines(out)[0]
    leased, deadline = line["leased"], min(line["deadlines"])
    assert len(leased) == 6
    got = drain(q)
    if time.time() < deadline:
        # The dead consumer's lease still runs (on a loaded machine it may not: the
        # worker's exit and this drain can outlast it, and then nothing is claimed).
        assert not set(got) & set(leased), "delivered again before the lease expired"
    want = {f"p{i}.0" for i in range(10)}

    def all_delivered() -> bool:
        # Waits for the set, not for a further delivery: on a loaded machine the lease
        # can expire before the drain above, which then gets the dead one's rollouts too.
        got.extend(drain(q))
        return set(got) >= want

    wait_for(all_delivered, 120, "the dead consumer's rollouts")
    assert sorted(got) == sorted(want)


@pytest.mark.parametrize("backend", CROSS_PROCESS, indirect=True)
def test_producers_and_consumers_in_separate_processes(backend: Backend, tmp_path: Path):
    stop = tmp_path / "stop"
    spec = backend.spec(30.0)
    consumers = [_spawn("consume", spec, str(stop)) for _ in range(2)]
    producers = [_spawn("produce", spec, f"p{k}", "60", "7") for k in range(2)]
    try:
        puts = []
        for p in producers:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            puts += [r for e in _lines(out) for r in e["put"]]
        stop.touch()
        acked: list[str] = []
        delivered: list[tuple[str, int]] = []
        for p in consumers:
            out, err = p.communicate(timeout=60)
            assert p.returncode == 0, err
            acked += [r for e in _lines(out) for r in e["acked"]]
            delivered += [(r, k) for e in _lines(out) for r, k in e["delivered"]]
    finally:
        for p in consumers + producers:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert len(puts) == 120
    # A consumer slower than its 30 s lease (a loaded machine) shares a rollout with
    # the next one: a delivery is at-least-once. Consumption is exactly once: one ack
    # of each rollout counts, whatever the timing.
    assert sorted(acked) == sorted(puts), "each rollout must be consumed exactly once"
    if backend.kind != "s3":
        # And a rollout goes to a second consumer only under a new attempt, once the
        # first one's lease expired. Not on moto's S3: its If-None-Match is checked,
        # then the object written, with no lock between (two concurrent creates can
        # both succeed: see spool.py), where S3's is atomic.
        assert len(set(delivered)) == len(delivered), "two consumers held one attempt"
    assert backend.make().pending() == 0


@pytest.mark.parametrize("backend", CROSS_PROCESS, indirect=True)
def test_a_consumer_slower_than_its_lease_does_not_consume_twice(backend: Backend, tmp_path: Path):
    # The slow consumer leases 5 for 0.5 s and acks only once the other consumer has
    # taken them over (their leases expired) and acked them: every rollout is
    # delivered twice, and each must still be consumed (its ack counted) once.
    q = backend.make("producer")
    ids = [f"p{i}.0" for i in range(12)]
    q.put(rollouts(ids))
    go, stop = tmp_path / "go", tmp_path / "stop"
    slow = _spawn("slow", backend.spec(0.5), "5", str(go))
    fast: subprocess.Popen[str] | None = None
    try:
        assert slow.stdout is not None
        first = json.loads(slow.stdout.readline())  # it holds its leases now
        held = [rid for rid, _ in first["delivered"]]
        assert len(held) == 5 and all(k == 1 for _, k in first["delivered"])
        stop.touch()  # the fast consumer drains what there is, then stops
        fast = _spawn("consume", backend.spec(30.0), str(stop))
        out, err = fast.communicate(timeout=120)
        assert fast.returncode == 0, err
        fast_lines = _lines(out)
        go.touch()  # only now does the slow one ack: late
        out, err = slow.communicate(timeout=60)
        assert slow.returncode == 0, err
        slow_lines = _lines(out)
    finally:
        for p in (slow, fast):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    again = {rid: k for e in fast_lines for rid, k in e.get("delivered", [])}
    assert all(again[rid] >= 2 for rid in held), "taken over only once the lease expired"
    acked = [r for e in fast_lines + slow_lines for r in e.get("acked", [])]
    assert sorted(acked) == sorted(ids), "each rollout must be consumed exactly once"
    assert sorted(slow_lines[-1]["late"]) == sorted(held), "the late acks counted nothing"
    assert q.pending() == 0 and q.counts()["acked"] == len(ids)


def test_controller_queue_survives_a_controller_restart(backend_controller: Backend):
    b = backend_controller
    a, c = b.make("a"), b.make("c")
    ids = [f"p{i}.0" for i in range(10)]
    a.put(rollouts(ids))
    held = a.lease(4)
    a.ack(held[:2])
    a.discard(held[2:3], "stale")
    assert b.ctl is not None
    b.ctl.kill(signal.SIGKILL)  # nothing flushed on the way out
    b.ctl.start()
    assert a.pending() == 7  # queued or leased; the settled ones are gone
    others = c.lease(10)  # the lease held across the restart is still held
    assert sorted(d.rollout_id for d in others) == sorted(set(ids) - {d.rollout_id for d in held})
    assert a.ack(held[3:]) == 1  # its holder acks it after the restart
    assert c.ack(others) == 6
    assert a.put(rollouts(ids[:3])) == []  # settled before the restart: duplicates
    assert drain(c) == [] and a.pending() == 0
    counts = a.counts()
    assert counts["put"] == 10 and counts["acked"] == 9 and counts["duplicates"] == 3
    assert counts["discarded"] == {"stale": 1} and counts["corrupt"] == 0
    st = b.ctl.status()
    assert st["queues"][b.name]["pending"] == 0 and st["queues"][b.name]["acked"] == 9
    text = status_text(Status.model_validate(st))
    assert f"queue {b.name}: pending 0 (leased 0), put 10, acked 9" in text


def test_controller_queue_refuses_malformed_requests_naming_the_field(
    backend_controller: Backend,
):
    ctl = backend_controller.ctl
    assert ctl is not None
    bad = [
        ("/v1/queue/put", {"queue": "q", "rollouts": [{"version": 1}]}, "rollouts"),
        ("/v1/queue/put", {"queue": "no/slash", "rollouts": [{"rollout_id": "p1.0"}]}, "queue"),
        ("/v1/queue/lease", {"queue": "q", "consumer": "c", "n": 0}, "n"),
        ("/v1/queue/lease", {"queue": "q", "consumer": "c", "lease_s": -1}, "lease_s"),
        (
            "/v1/queue/ack",
            {"queue": "q", "deliveries": [{"rollout_id": "p1.0"}]},
            "deliveries.0.attempt",
        ),
        (
            "/v1/queue/discard",
            {"queue": "q", "deliveries": [{"rollout_id": "p", "attempt": 1}]},
            "reason",
        ),
    ]
    for path, body, field in bad:
        r = ctl.post(path, body)
        assert r.status_code == 422, (path, body, r.text)
        assert field in [f["field"] for f in r.json()["fields"]], (path, r.json())
    assert "q" not in ctl.status().get("queues", {}), "a refused request changed nothing"
    assert (
        ctl.post(
            "/v1/queue/put", {"queue": "q", "rollouts": [{"rollout_id": "x"}]}, headers={}
        ).status_code
        == 401
    )


def test_controller_queue_splits_a_put_over_the_body_limit(backend_controller: Backend):
    q = backend_controller.make()
    big = [{**r, "payload": "x" * 100_000} for r in rollouts([f"p{i}.0" for i in range(25)])]
    assert q.put(big) == [r["rollout_id"] for r in big]  # 2.5 MB: over the 1 MiB limit
    assert sorted(drain(q)) == sorted(r["rollout_id"] for r in big)
    huge = {**rollouts(["p99.0"])[0], "payload": "x" * (1 << 20)}
    with pytest.raises(TransportError, match="must fit in one request"):
        q.put([huge])


@pytest.mark.parametrize("backend", ["file", "memory", "s3"], indirect=True)
def test_spool_markers_are_created_exclusively(backend: Backend):
    # Two consumers must never both take one attempt of a rollout: a lease marker is
    # created only if absent. On S3 that needs If-None-Match on a non-empty body.
    q = backend.make()
    assert isinstance(q, SpoolRolloutQueue)
    path = f"{q.root}/leases/p1.0@1"
    assert q._create(path) is True
    assert q._create(path) is False

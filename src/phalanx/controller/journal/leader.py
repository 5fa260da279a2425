"""Who may write a job's etcd journal: the leader, fenced by its leader key.

Keys, under the job's prefix ``P``:

- ``P/job``: ``{"job_id"}``, written by the first controller of the job; a controller
  of another job pointed at the same prefix is refused.
- ``P/term``: ``{"term", "url", "since"}``, the count of leader terms (the first
  controller is term 1, each one that takes over adds one: the failovers are
  ``term - 1``). Never leased.
- ``P/leader``: ``{"url", "since", "term", "pid"}``, attached to the leader's lease
  (:data:`LEASE_TTL_S`, kept alive every :data:`KEEP_ALIVE_S` by a thread). It goes
  when the lease lapses (the leader died, was stopped, or lost etcd) or is revoked (a
  clean stop, or a standby that found the leader's port refused). A standby watches
  it to take over (:mod:`phalanx.controller.standby`).
- ``P/standby/<url>``: ``{"url", "since"}``, each standby on a lease of its own.
- ``P/token``: the job token, for controllers on hosts without the state dir.

Taking office is one transaction: *if* ``P/leader`` is absent and ``P/term`` is as
read, *then* put the new term and the leader key. Its revision is the leader key's
``mod_revision``, and every write of the leader is a transaction that first
compares the leader key's ``mod_revision`` with it (:meth:`Leadership.fence`).
Another controller can only take the key once it is gone, and then bumps the
term, so a deposed leader, even one that wakes from a SIGSTOP believing it still
leads, has every write refused by etcd itself.

A leader whose lease lapsed while nobody took over (etcd was stopped longer than
the TTL, and expired the lease as it came back) takes its key again, in the same
term: the unchanged ``P/term`` proves nobody led in between
(:meth:`Leadership.recover`).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

from phalanx.controller.journal.base import Deposed, JournalUnavailable
from phalanx.controller.journal.etcd_kv import KV, EtcdKV, get, put, ranged, revision, same_mod
from phalanx.controller.statedir import CannotStart

log = logging.getLogger("phalanx.controller")

LEASE_TTL_S = 2
"""The leader key's lease: a controller that dies leaves its key for at most this
long (then a restarted or standby controller takes over). etcd's shortest lease is
about 1.5 s with its default timings (it rounds a shorter one up); a standby on the
leader's host network finds a dead leader sooner, by a refused connection
(:mod:`phalanx.controller.standby`)."""
KEEP_ALIVE_S = LEASE_TTL_S / 4
"""How often the leader refreshes its lease."""
FENCE_AFTER_S = LEASE_TTL_S - 0.5
"""A leader that has not had a refresh acknowledged for this long (counted from when
the last acknowledged one was sent, on the monotonic clock, so a SIGSTOP shows as a
jump) stops answering (:meth:`Leadership.fenced`): its lease may lapse, and a standby
take over, before its keep-alive can find out. The margin covers the clock steps of
one request."""


def _json(kv: KV | None) -> dict[str, Any]:
    if kv is None:
        return {}
    try:
        out = json.loads(kv["value"])
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


def describe(leader: dict[str, Any]) -> str:
    """``the controller at URL (term N, since TIME)``, for messages."""
    since = leader.get("since")
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if since else "?"
    return (
        f"the controller at {leader.get('url', '?')} (term {leader.get('term', '?')}, since {when})"
    )


class Leadership:
    """This controller's term as the job's leader: the lease, the leader key's revision
    that fences every write, and the thread that keeps the lease alive."""

    def __init__(self, kv: EtcdKV, keep: EtcdKV, prefix: str, job_id: str, url: str):
        self.kv, self.keep = kv, keep
        """``kv`` for the writer; ``keep`` (its own sessions) for the keep-alive thread."""
        self.prefix, self.job_id, self.url = prefix, job_id, url
        self.job_key, self.term_key, self.leader_key = (
            f"{prefix}/{k}" for k in ("job", "term", "leader")
        )
        self.term = 0
        self.term_rev = 0
        """``P/term``'s ``mod_revision`` when this controller took office."""
        self.leader_rev = 0
        """``P/leader``'s ``mod_revision``: what every write compares."""
        self.lease = 0
        self.lapsed = False
        """The keep-alive found the lease gone (the next write tries :meth:`recover`)."""
        self.deposed = ""
        """Why this controller no longer leads ('' while it does)."""
        self.since = 0.0
        """When this controller took office (wall clock)."""
        self.renewed = 0.0
        """``time.monotonic()`` when the last refresh etcd acknowledged was sent."""
        self.standbys: list[dict[str, Any]] = []
        """The standbys registered under ``P/standby/`` (read by the keep-alive)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        """Held while deciding whether this controller still leads (the writer and the
        keep-alive thread may both find the lease lapsed)."""

    def take(self, wait_s: float) -> None:
        """Take office, or raise CannotStart in one line: another job holds the prefix,
        or a leader is alive (its key still there after ``wait_s``: the key of one that
        died goes within a lease TTL, so a restart right after a SIGKILL waits)."""
        deadline = time.monotonic() + wait_s
        while True:
            leader = self.campaign()
            if leader is None:
                return
            if leader and time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            if leader:
                raise CannotStart(
                    f"job {self.job_id!r} must have one leader: {describe(leader)} leads "
                    f"it (etcd key {self.leader_key}). Stop that controller first; its key "
                    f"goes {LEASE_TTL_S} s after it stops."
                )

    def campaign(self) -> dict[str, Any] | None:
        """One try at taking office. Returns None once this controller leads (its
        keep-alive started), else the leader key's value (``{}``: the key changed
        meanwhile, try again). Raises CannotStart when another job holds the prefix."""
        got = self.kv.txn([], [get(self.job_key), get(self.term_key), get(self.leader_key)], [])
        job, term, leader = (ranged(got, i) for i in range(3))
        other = _json(job).get("job_id")
        if job is not None and other != self.job_id:
            raise CannotStart(
                f"etcd prefix {self.prefix} must hold one job: it holds job {other!r}, and "
                f"this is job {self.job_id!r}. Give this job its own prefix "
                f"(controller.journal = etcd://HOST:PORT/OTHER/PREFIX), or its own job.id."
            )
        if leader is not None:
            return _json(leader) or {"url": "?"}
        if not self._start_term(job is None, term):
            return {}
        self._thread = threading.Thread(target=self._keep_alive, name="etcd-lease", daemon=True)
        self._thread.start()
        return None

    def _start_term(self, new_job: bool, term: KV | None) -> bool:
        """The one transaction that takes office; False if something changed meanwhile."""
        n = int(_json(term).get("term", 0)) + 1
        now = time.time()
        sent = time.monotonic()
        lease = self.kv.grant(LEASE_TTL_S)
        value = {"url": self.url, "since": now, "term": n, "pid": os.getpid()}
        ops = [
            put(self.term_key, json.dumps({"term": n, "url": self.url, "since": now}).encode()),
            put(self.leader_key, json.dumps(value).encode(), lease),
        ]
        if new_job:
            ops.append(put(self.job_key, json.dumps({"job_id": self.job_id}).encode()))
        compare = [
            same_mod(self.leader_key, 0),
            same_mod(self.term_key, term["mod_revision"] if term else 0),
        ]
        if new_job:
            compare.append(same_mod(self.job_key, 0))
        reply = self.kv.txn(compare, ops, [])
        if not reply.get("succeeded"):
            self._revoke(lease)
            return False
        self.term, self.lease, self.lapsed, self.renewed = n, lease, False, sent
        self.term_rev = self.leader_rev = revision(reply)
        self.since = now
        log.info("etcd journal: leader of job %s, term %d (%s)", self.job_id, n, self.leader_key)
        return True

    def fence(self) -> dict[str, Any]:
        """The compare every write of the leader carries."""
        return same_mod(self.leader_key, self.leader_rev)

    def lost(self) -> list[dict[str, Any]]:
        """The failure branch of a fenced write: what the leader and term keys hold."""
        return [get(self.leader_key), get(self.term_key)]

    def recover(self, reply: dict[str, Any]) -> None:
        """After a fenced write failed its compare (``reply``, whose failure branch was
        :meth:`lost`): take the leader key again if nobody led since, else raise
        :class:`Deposed` (and remember it: every later write is refused at once)."""
        with self._lock:
            self._resolve(self.kv, ranged(reply, 0), ranged(reply, 1))

    def _resolve(self, kv: EtcdKV, leader: KV | None, term: KV | None) -> None:
        """Whether this controller still leads, given the leader and term keys as read:
        its own key (the other thread took it again already), a key nobody holds in an
        unchanged term (take it again), or another's (:class:`Deposed`)."""
        if self._stop.is_set():  # closing: its own revoke removed the key
            raise JournalUnavailable("the etcd journal is closing")
        if leader is not None and leader["lease"] == self.lease:
            self.leader_rev, self.lapsed = leader["mod_revision"], False
            return
        if leader is None and term is not None and term["mod_revision"] == self.term_rev:
            sent = time.monotonic()
            lease = kv.grant(LEASE_TTL_S)
            value = {"url": self.url, "since": time.time(), "term": self.term, "pid": os.getpid()}
            again = kv.txn(
                [same_mod(self.leader_key, 0), same_mod(self.term_key, self.term_rev)],
                [put(self.leader_key, json.dumps(value).encode(), lease)],
                self.lost(),
            )
            if again.get("succeeded"):
                old, self.lease, self.lapsed, self.renewed = self.lease, lease, False, sent
                self.leader_rev = revision(again)
                log.warning(
                    "etcd journal: the leader key's lease lapsed and nobody took over: "
                    "took it again (term %d)",
                    self.term,
                )
                self._revoke(old)
                return
            self._revoke(lease)
            leader = ranged(again, 0)
            if leader is not None and leader["lease"] == self.lease:
                # The keep-alive thread took it again meanwhile (under this lock, in
                # the read's window): still this controller's.
                self.leader_rev, self.lapsed = leader["mod_revision"], False
                return
        who = describe(_json(leader)) if leader is not None else "another controller"
        self.deposed = (
            f"this controller (term {self.term}) no longer leads job {self.job_id!r}: "
            f"{who} took over after its lease lapsed"
        )
        raise Deposed(self.deposed)

    def fenced(self) -> str:
        """Why this controller must not answer now ('' when it may): deposed, or no
        refresh acknowledged for :data:`FENCE_AFTER_S` (etcd may have let its lease
        lapse, and a standby may lead already). Cheap: every request asks. Lifted when
        a refresh lands again (etcd unreachable for a while, nobody took over)."""
        if self.deposed:
            return self.deposed
        quiet = time.monotonic() - self.renewed
        if self.renewed and quiet > FENCE_AFTER_S:
            return (
                f"this controller (term {self.term}) has had no lease refresh acknowledged by "
                f"etcd for {quiet:.1f} s, so it may no longer lead job {self.job_id!r}: retry "
                f"on another controller"
            )
        return ""

    def _keep_alive(self) -> None:
        """Refresh the lease every :data:`KEEP_ALIVE_S`. When etcd says it lapsed, find
        out at once whether this controller still leads (:meth:`_resolve`): a controller
        woken from a SIGSTOP learns it was deposed here, without waiting for a write.
        Each round also reads the registered standbys (for the status)."""
        while not self._stop.wait(KEEP_ALIVE_S):
            lease = self.lease
            try:
                sent = time.monotonic()
                ttl = self.keep.keep_alive(lease)
                if ttl > 0 and lease == self.lease:
                    self.renewed = max(self.renewed, sent)
                    self._read_standbys()
                if ttl > 0 or lease != self.lease or self.deposed:
                    continue
                self.lapsed = True
                log.warning("etcd journal: the leader key's lease lapsed (etcd did not hear it)")
                got = self.keep.txn([], self.lost(), [])
                with self._lock:
                    if lease == self.lease:  # not taken again by a write meanwhile
                        self._resolve(self.keep, ranged(got, 0), ranged(got, 1))
            except (JournalUnavailable, Deposed):
                continue  # the writes say so (Deposed is kept in self.deposed)

    def _read_standbys(self) -> None:
        rows = self.keep.range_prefix(f"{self.prefix}/standby/")
        self.standbys = [v for v in (_json(kv) for kv in rows) if v.get("url")]

    def _revoke(self, lease: int) -> None:
        try:
            self.kv.revoke(lease)
        except JournalUnavailable:
            pass  # it lapses by itself

    def close(self) -> None:
        """Stop the keep-alive and, unless deposed, revoke the lease: the leader key goes
        at once, so a restarted controller need not wait for it to lapse."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.keep.timeout_s + 1)
        if self.lease and not self.deposed:
            self._revoke(self.lease)

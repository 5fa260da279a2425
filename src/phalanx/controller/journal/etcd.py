"""The controller's journal in an existing etcd cluster (``controller.journal =
"etcd://host:port[,host:port...][/prefix]"``): etcd's Raft replicates it, so the
job's state outlives the controller's host. We run no consensus of our own.

Keys, under the job's prefix ``P`` (``/phalanx/<job.id>`` unless the URL names one;
``leader.py`` describes ``P/job``, ``P/term`` and ``P/leader``):

- ``P/rec/<table>/<key>``: one journal row, its record as compact JSON; what
  :meth:`EtcdJournal.load` returns, the same tables the SQLite journal holds.
- ``P/stage/<id>/<part>`` and ``P/commit``: a batch too large for one transaction,
  in flight (below).

**Group commit.** One :meth:`EtcdJournal.write` is one batch, normally one etcd
transaction: *if* the leader key's ``mod_revision`` is this leader's (the fence)
*then* put and delete its rows. One round trip, whatever the batch holds. A batch
holds the changes of one controller tick (one core call) or, as the outbox sends
them (:attr:`group_commit`), of every call made while the previous batch was in
flight.

**Large batches.** etcd refuses a transaction of more than 128 operations
(``--max-txn-ops``) or 1.5 MiB (``--max-request-bytes``), and an etcd we did not
start may not be told otherwise. A batch over :data:`MAX_OPS` rows or
:data:`MAX_BYTES` stays atomic by another road:

1. its rows, as one JSON array, are written in parts of at most :data:`MAX_BYTES`
   to ``P/stage/<id>/<part>`` (fenced transactions, invisible to a load);
2. one fenced transaction puts ``P/commit = {"id", "parts"}``: the commit point;
3. the rows are folded into ``P/rec/`` in transactions of at most :data:`MAX_OPS`
   rows and :data:`MAX_BYTES`, and a last one deletes ``P/commit`` and ``P/stage/``.

A load that finds ``P/commit`` applies its staged rows over ``P/rec/`` (folding may
have stopped half way: the rows are final values, so applying them twice is
harmless) and the next write finishes the fold before anything else, so a batch's
rows are never overtaken by a later one's. Staged parts without a commit (a writer
that died before step 2) are ignored and deleted. The cost: a large batch takes its
size / 1 MiB + 2 round trips more, and writes its bytes twice; the common tick (a few
rows) pays nothing for it. A single row must stay under :data:`MAX_BYTES` (the
core's records are a few hundred bytes).

**Failures.** A write that cannot reach a cluster able to commit (no quorum, every
endpoint down or silent for :data:`TIMEOUT_S`) raises :class:`JournalUnavailable`;
the batch may have landed or not, and the service writes it again later with the
changes since (idempotent: final values and deletes). A write whose fence fails
raises :class:`Deposed`, unless the lease merely lapsed with nobody taking over
(``leader.py``). etcd keeps every revision until it is compacted: run it with
``--auto-compaction-retention`` (docs/operations.md, "An etcd journal").
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from phalanx.config.journal import EtcdTarget
from phalanx.controller.core.base import Change
from phalanx.controller.core.codec import encode_bytes
from phalanx.controller.journal.base import (
    Deposed,
    Journal,
    JournalUnavailable,
    Tables,
    decode,
    last_wins,
)
from phalanx.controller.journal.etcd_kv import (
    EtcdKV,
    Op,
    after_prefix,
    b64,
    delete,
    delete_prefix,
    put,
)
from phalanx.controller.journal.leader import LEASE_TTL_S, Leadership
from phalanx.controller.statedir import CannotStart
from phalanx.protocol.status import Controllers, StandbyInfo

MAX_OPS = 100
"""Rows per transaction (etcd's default ``--max-txn-ops`` is 128)."""
MAX_BYTES = 1 << 20
"""Bytes of keys and values per transaction (etcd's default ``--max-request-bytes``
is 1.5 MiB; the gateway's base64 and the request's framing take some of the rest)."""
TIMEOUT_S = 2.0
"""How long one etcd call may take before it counts as unavailable (writes run on the
outbox's worker thread, so the controller's loop does not wait on it)."""

Row = tuple[str, str, "dict[str, Any] | None"]
_FIX = (
    "Restore the prefix from a backup (etcdctl snapshot), or delete it to begin the job "
    "again at epoch 1."
)


class EtcdJournal(Journal):
    """The job's journal in etcd, written only by the job's leader: constructing one
    takes the leader key (``leader.py``), or raises CannotStart in one line."""

    kind = "etcd"
    group_commit = True

    def __init__(
        self,
        target: EtcdTarget,
        job_id: str,
        leader_url: str,
        take_wait_s: float | None = None,
        leader: Leadership | None = None,
        tables: Tables | None = None,
    ):
        """``leader``: the office a standby took already (its tables, kept current by
        its watch, are ``tables``: :meth:`load` returns them instead of reading the
        prefix again); None: take office here, waiting up to ``take_wait_s``."""
        self.prefix = target.prefix_for(job_id)
        self.where = target.url(self.prefix)
        self.writes = 0
        self.kv = leader.kv if leader is not None else EtcdKV(target, TIMEOUT_S)
        self._tables = tables
        self.rec_prefix = f"{self.prefix}/rec/"
        self.stage_prefix = f"{self.prefix}/stage/"
        self.commit_key = f"{self.prefix}/commit"
        self._unsettled = False
        """A large batch may be committed and not folded yet (or staged parts left over):
        the next write settles it first."""
        if leader is not None:
            self.leader = leader
            return
        try:
            self.kv.call("maintenance/status", {})
        except JournalUnavailable as e:
            raise CannotStart(
                f"controller.journal {target.url()} must name an etcd that answers: {e}. Start "
                f'etcd there, or point controller.journal at a running cluster (or "sqlite").'
            ) from None
        self.leader = Leadership(
            self.kv, EtcdKV(target, LEASE_TTL_S / 3), self.prefix, job_id, leader_url
        )
        try:
            self.leader.take(LEASE_TTL_S + 1.0 if take_wait_s is None else take_wait_s)
        except JournalUnavailable as e:
            raise CannotStart(f"etcd journal {self.where} cannot be taken: {e}.") from None

    @property
    def term(self) -> int | None:
        return self.leader.term

    @property
    def deposed(self) -> str:
        return self.leader.deposed

    def controllers(self) -> Controllers:
        led = self.leader
        standbys = [
            StandbyInfo(url=str(s["url"]), since=float(s.get("since", 0.0)))
            for s in led.standbys[:64]
            if s["url"] != led.url  # its own key, until its lease lapses
        ]
        return Controllers(
            leader=led.url,
            since=led.since,
            term=led.term,
            failovers=max(0, led.term - 1),
            standbys=standbys,
        )

    # -- load ---------------------------------------------------------------

    def empty(self) -> bool:
        """Whether the prefix holds no row yet (this job's first controller on etcd).
        Raises :class:`~phalanx.controller.statedir.CannotStart` when etcd cannot say."""
        body = {"key": b64(self.rec_prefix), "range_end": after_prefix(self.rec_prefix)}
        try:
            reply = self.kv.call("kv/range", {**body, "count_only": True})
            return int(reply.get("count", 0)) == 0 and self.kv.get(self.commit_key) is None
        except JournalUnavailable as e:
            raise CannotStart(f"etcd journal {self.where} cannot be read: {e}.") from None

    def load(self) -> Tables:
        try:
            rows = [] if self._tables is not None else self.kv.range_prefix(self.rec_prefix)
            staged = self._committed()
        except JournalUnavailable as e:
            raise CannotStart(f"etcd journal {self.where} cannot be read: {e}.") from None
        tables: Tables = self._tables if self._tables is not None else {}
        self._tables = None
        for kv in rows:
            tbl, _, key = kv["key"].decode()[len(self.rec_prefix) :].partition("/")
            text = kv["value"].decode(errors="replace")
            tables.setdefault(tbl, {})[key] = decode(self.where, tbl, key, text, _FIX)
        for tbl, key, rec in staged or []:
            if rec is None:
                tables.get(tbl, {}).pop(key, None)
            else:
                tables.setdefault(tbl, {})[key] = rec
        return tables

    def _committed(self) -> list[Row] | None:
        """The rows of a committed, unfolded large batch (None: there is none). Notes
        that the next write must settle it (and any staged parts left over)."""
        stage = self.kv.range_prefix(self.stage_prefix)
        commit = self.kv.get(self.commit_key)
        self._unsettled = bool(stage) or commit is not None
        if commit is None:
            return None
        meta = json.loads(commit["value"])
        mine = f"{self.stage_prefix}{meta['id']}/"
        parts = [kv for kv in stage if kv["key"].decode().startswith(mine)]
        if len(parts) != meta["parts"]:
            raise CannotStart(
                f"etcd journal {self.where} is damaged: its committed batch {meta['id']} has "
                f"{len(parts)} of {meta['parts']} parts. Restore the prefix from a backup."
            )
        rows = json.loads(b"".join(kv["value"] for kv in parts))
        return [(t, k, r) for t, k, r in rows]

    # -- write --------------------------------------------------------------

    def write(self, changes: list[Change]) -> None:
        if not changes:
            return
        if self.leader.deposed:
            raise Deposed(self.leader.deposed)
        if self._unsettled:
            self._settle()
        rows = [(t, k, r) for (t, k), r in last_wins(changes).items()]
        ops = [self._op(row) for row in rows]
        if len(ops) <= MAX_OPS and _size(ops) <= MAX_BYTES:
            self._fenced(ops)
        else:
            self._write_large(rows)
        self.writes += 1

    def _op(self, row: Row) -> Op:
        tbl, key, rec = row
        if "/" in tbl:
            raise ValueError(f"journal table names hold no '/': got {tbl!r}")
        k = f"{self.rec_prefix}{tbl}/{key}"
        return delete(k) if rec is None else put(k, encode_bytes(rec))

    def _fenced(self, ops: list[Op]) -> None:
        """One transaction of ``ops``, applied only while this controller leads."""
        for attempt in range(2):
            reply = self.kv.txn([self.leader.fence()], ops, self.leader.lost())
            if reply.get("succeeded"):
                return
            if attempt:
                break
            self.leader.recover(reply)  # raises Deposed, or leads again: try once more
        self.leader.deposed = self.leader.deposed or "the leader key changed twice in a row"
        raise Deposed(self.leader.deposed)

    def _write_large(self, rows: list[Row]) -> None:
        data = encode_bytes([list(r) for r in rows])
        bid = uuid.uuid4().hex[:12]
        parts = [data[i : i + MAX_BYTES] for i in range(0, len(data), MAX_BYTES)]
        for i, part in enumerate(parts):
            self._fenced([put(f"{self.stage_prefix}{bid}/{i:06d}", part)])
        self._unsettled = True  # from here the commit may have landed, even if this raises
        self._fenced([put(self.commit_key, json.dumps({"id": bid, "parts": len(parts)}).encode())])
        try:
            self._fold(rows)
        except JournalUnavailable:
            pass  # committed: the next write finishes the fold first

    def _settle(self) -> None:
        """Finish a committed large batch's fold; drop staged parts without a commit."""
        rows = self._committed()
        if rows is not None:
            self._fold(rows)
        else:
            self._fenced([delete_prefix(self.stage_prefix)])
            self._unsettled = False

    def _fold(self, rows: list[Row]) -> None:
        batch: list[Op] = []
        size = 0
        for op in (self._op(row) for row in rows):
            n = _size([op])
            if batch and (len(batch) >= MAX_OPS or size + n > MAX_BYTES):
                self._fenced(batch)
                batch, size = [], 0
            batch.append(op)
            size += n
        if batch:
            self._fenced(batch)
        self._fenced([delete(self.commit_key), delete_prefix(self.stage_prefix)])
        self._unsettled = False

    def close(self) -> None:
        self.leader.close()


def _size(ops: list[Op]) -> int:
    """Bytes of the keys and values of an op list (as etcd counts them, not base64)."""
    n = 0
    for op in ops:
        req = op.get("request_put") or op.get("request_delete_range") or {}
        n += (len(req.get("key", "")) + len(req.get("value", ""))) * 3 // 4
    return n

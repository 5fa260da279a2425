"""A standby's copy of the job's journal, kept current by an etcd watch.

:class:`Follower` reads the job's whole prefix once (``P/rec/`` rows, ``P/leader``)
at one revision, then watches the prefix from the next revision on a thread of its
own and applies every event: a ``P/rec/<table>/<key>`` put or delete to its tables,
``P/leader`` to what it knows of the leader. So a standby that takes over builds its
state machine from memory, after waiting only for the watch to reach the revision
at which it took office (:meth:`Follower.handover`).

The watch is etcd's own (``POST /v3/watch`` on the JSON gateway, one JSON object
per line), read here with ``requests`` rather than through etcd3gw's ``Watcher``:
that one reads raw chunks (a line split across two chunks fails to parse), gives no
way to see a cancelled watch, and dies silently on a read timeout. Here a stream
that ends, times out (:data:`READ_TIMEOUT_S` without an event: a stopped member
looks the same as a quiet job) or fails is opened again from the next revision,
on the next endpoint; a watch cancelled because etcd compacted past that revision
reads the prefix again from scratch.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import requests

from phalanx.controller.journal.base import Tables, decode
from phalanx.controller.journal.etcd_kv import KV, EtcdKV, after_prefix, b64, decode_kv

log = logging.getLogger("phalanx.controller")

READ_TIMEOUT_S = 5.0
"""A watch stream silent this long is opened again (from the next revision)."""
_FIX = "The leader wrote it: check the etcd cluster's health."


class Follower:
    """The tables of one job's prefix, as of :attr:`revision`. Started by the standby
    (:meth:`start`), stopped by :meth:`handover` or :meth:`close`. ``on_leader`` is
    called (on the watch thread) with the leader key's value whenever it changes
    (``None``: the key went, so an election is due)."""

    def __init__(self, kv: EtcdKV, prefix: str, on_leader: Callable[[dict[str, Any] | None], None]):
        self.kv, self.prefix, self.on_leader = kv, prefix, on_leader
        self.rec = f"{prefix}/rec/"
        self.leader_key = f"{prefix}/leader"
        self.tables: Tables = {}
        self.leader: dict[str, Any] | None = None
        self.revision = 0
        """The last revision applied (the watch has delivered everything up to it)."""
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reloads = 0
        """Full reads of the prefix (1 at start; more only after a compaction)."""

    def start(self) -> None:
        """Read the prefix (raises JournalUnavailable if etcd does not answer), then
        follow it on a daemon thread."""
        self._load()
        self._thread = threading.Thread(target=self._run, name="etcd-follow", daemon=True)
        self._thread.start()

    def _load(self) -> None:
        rows, rev = self.kv.range_at(f"{self.prefix}/")
        with self._cond:
            self.tables, self.leader = {}, None
            for kv in rows:
                self._apply(kv, deleted=False)
            self.revision = rev
            self.reloads += 1
            self._cond.notify_all()

    def _apply(self, kv: KV, deleted: bool) -> None:
        key = kv["key"].decode(errors="replace")
        if key.startswith(self.rec):
            tbl, _, row = key[len(self.rec) :].partition("/")
            if deleted:
                self.tables.get(tbl, {}).pop(row, None)
            else:
                text = kv["value"].decode(errors="replace")
                self.tables.setdefault(tbl, {})[row] = decode(self.prefix, tbl, row, text, _FIX)
        elif key == self.leader_key:
            value = None if deleted else _json(kv["value"])
            self.leader = value
            self.on_leader(value)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                compacted = self._watch()
            except (requests.RequestException, ValueError, KeyError, AttributeError) as e:
                # AttributeError: urllib3 reading a stream that close() took away.
                if self._stop.is_set():
                    return
                log.debug("etcd watch of %s: %s (opened again)", self.prefix, e)
                self.kv.next_endpoint()
                self._stop.wait(0.05)
                continue
            if compacted and not self._stop.is_set():
                log.warning(
                    "etcd watch of %s: compacted past revision %d, read again",
                    self.prefix,
                    self.revision,
                )
                try:
                    self._load()
                except Exception as e:  # etcd down: the next round tries again
                    log.debug("etcd reload of %s: %s", self.prefix, e)
                    self._stop.wait(0.2)

    def _watch(self) -> bool:
        """Follow one watch stream until it ends. True: etcd compacted past it."""
        host, port = self.kv.endpoint()
        host = f"[{host}]" if ":" in host else host
        body = {
            "create_request": {
                "key": b64(f"{self.prefix}/"),
                "range_end": after_prefix(f"{self.prefix}/"),
                "start_revision": str(self.revision + 1),
            }
        }
        with self.kv.session() as http:  # (the cluster's TLS, as the journal's calls)
            resp = http.post(
                f"{self.kv.target.scheme}://{host}:{port}/v3/watch",
                json=body,
                stream=True,
                timeout=(2.0, READ_TIMEOUT_S),
            )
            try:
                # chunk_size None: each line as it arrives (512, the default, waits for more).
                for line in resp.iter_lines(chunk_size=None):  # type: ignore[call-overload]
                    if self._stop.is_set():
                        return False
                    if not line.strip():
                        continue
                    result = json.loads(line).get("result", {})
                    if result.get("canceled"):
                        return bool(result.get("compact_revision"))
                    events = result.get("events", [])
                    if not events:
                        continue
                    with self._cond:
                        if self._stop.is_set():
                            return False
                        for ev in events:
                            kv = decode_kv(ev["kv"])
                            self._apply(kv, deleted=ev.get("type") == "DELETE")
                            self.revision = max(self.revision, kv["mod_revision"])
                        self._cond.notify_all()
            finally:
                resp.close()
        return False

    def handover(self, revision: int, timeout_s: float) -> Tables | None:
        """Stop following once everything up to ``revision`` (the one at which this
        controller took office) is applied, and give the tables up. None: the watch did
        not get there within ``timeout_s`` (the caller reads the prefix instead)."""
        with self._cond:
            ok = self._cond.wait_for(lambda: self.revision >= revision, timeout_s)
            self._stop.set()
            tables = self.tables if ok else None
        self.close()
        return tables

    def close(self) -> None:
        """Stop applying events at once. The watch thread ends at the stream's next
        line or read timeout: closing the stream from here would block until then
        (urllib3 closes under the reader's lock), and a takeover must not wait."""
        self._stop.set()


def _json(raw: bytes) -> dict[str, Any]:
    try:
        out = json.loads(raw)
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}

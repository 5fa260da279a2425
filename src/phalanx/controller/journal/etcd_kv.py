"""The few etcd v3 calls the etcd journal makes, through etcd3gw (OpenStack's client
for etcd's JSON gateway, ``/v3/kv/txn`` and friends): transactions, ranges and
leases, over one or more endpoints of a cluster.

Keys and values travel base64-encoded (the gateway's JSON); keys are UTF-8 here
(etcd3gw's own helpers encode a text key as Latin-1, so the ops are built here).

Failover between endpoints: a call goes to the current endpoint; a refused
connection moves on to the next at once (within the same call), a timeout moves
the next call to the next endpoint and raises :class:`JournalUnavailable` (waiting
again on another member would stall the controller's loop twice as long). Every
failure to reach a cluster that can commit (no answer, no leader, no quorum, an
etcd error such as a full database) raises :class:`JournalUnavailable` with a line
that names the endpoint and etcd's reason.

Each thread gets its own HTTP session (the lease's keep-alive thread beside the
writer)."""

from __future__ import annotations

import base64
import os
import threading
from typing import Any

import requests
from etcd3gw.client import Etcd3Client
from etcd3gw.exceptions import (
    ConnectionFailedError,
    ConnectionTimeoutError,
    Etcd3Exception,
)

from phalanx.config.journal import EtcdTarget
from phalanx.controller.journal.base import JournalUnavailable

Op = dict[str, Any]
KV = dict[str, Any]
"""A key-value as a range returns it: ``key`` and ``value`` decoded to bytes,
``mod_revision``, ``version`` and ``lease`` as ints."""


def b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def after_prefix(prefix: str) -> str:
    """The range end that covers every key starting with ``prefix``."""
    raw = prefix.encode()
    return b64(raw[:-1] + bytes([raw[-1] + 1]))


def put(key: str, value: bytes, lease: int = 0) -> Op:
    req: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        req["lease"] = str(lease)
    return {"request_put": req}


def delete(key: str) -> Op:
    return {"request_delete_range": {"key": b64(key)}}


def delete_prefix(prefix: str) -> Op:
    return {"request_delete_range": {"key": b64(prefix), "range_end": after_prefix(prefix)}}


def get(key: str) -> Op:
    return {"request_range": {"key": b64(key)}}


def same_mod(key: str, revision: int) -> dict[str, Any]:
    """Holds when ``key``'s last write is at ``revision`` (a missing key: 0)."""
    return {"key": b64(key), "result": "EQUAL", "target": "MOD", "mod_revision": str(revision)}


def decode_kv(raw: dict[str, Any]) -> KV:
    """A key-value as the gateway sends it (base64, numbers as text), decoded."""
    return {
        "key": base64.b64decode(raw["key"]),
        "value": base64.b64decode(raw.get("value", "")),
        "mod_revision": int(raw.get("mod_revision", 0)),
        "version": int(raw.get("version", 0)),
        "lease": int(raw.get("lease", 0)),
    }


def ranged(reply: dict[str, Any], i: int) -> KV | None:
    """The key-value the ``i``-th op of a txn (a :func:`get`) found, or None."""
    kvs = reply.get("responses", [])[i].get("response_range", {}).get("kvs", [])
    return decode_kv(kvs[0]) if kvs else None


def revision(reply: dict[str, Any]) -> int:
    """The store's revision after a call (a txn's own when it wrote)."""
    return int(reply["header"]["revision"])


class EtcdKV:
    """One etcd cluster, reached through any of its endpoints."""

    def __init__(self, target: EtcdTarget, timeout_s: float):
        """Raises :class:`JournalUnavailable` when a TLS file it is given cannot be read."""
        for what, path in (
            ("etcd_ca_file", target.ca_file),
            ("etcd_cert_file", target.cert_file),
            ("etcd_key_file", target.key_file),
        ):
            if path and not os.access(path, os.R_OK):
                why = "no such file" if not os.path.exists(path) else "not readable by this user"
                raise JournalUnavailable(f"controller.{what} {path} cannot be read ({why})")
        self.target = target
        self.timeout_s = timeout_s
        self._current = 0
        self._local = threading.local()

    def _client(self, i: int) -> Etcd3Client:
        clients: dict[int, Etcd3Client] | None = getattr(self._local, "clients", None)
        if clients is None:
            clients = self._local.clients = {}
        if i not in clients:
            host, port = self.target.endpoints[i]
            # api_path given: no /version round trip before the first call.
            clients[i] = Etcd3Client(
                host,
                port,
                protocol=self.target.scheme,
                timeout=self.timeout_s,
                api_path="/v3/",
                session=self.session(),
            )
        return clients[i]

    def session(self) -> requests.Session:
        """A new HTTP session for this cluster: its TLS CA and client certificate. A CA
        file given is the one to trust: requests would put $REQUESTS_CA_BUNDLE before a
        session's own (its environment wins over session settings)."""
        t = self.target
        session = requests.Session()
        session.trust_env = t.ca_file is None
        session.verify = t.verify()
        session.cert = t.client_cert()
        return session

    def endpoint(self) -> tuple[str, int]:
        """The endpoint calls go to now (host, port)."""
        return self.target.endpoints[self._current]

    def next_endpoint(self) -> None:
        """Send the next call to the next endpoint (this one failed a stream)."""
        self._current = (self._current + 1) % len(self.target.endpoints)

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to the gateway's ``/v3/<path>`` on the current endpoint (see
        the module docstring for failover). Returns etcd's reply."""
        n = len(self.target.endpoints)
        first = self._current
        why = ""
        for k in range(n):
            i = (first + k) % n
            client = self._client(i)
            host, port = self.target.endpoints[i]
            where = f"etcd at {host}:{port}"
            try:
                reply: dict[str, Any] = client.post(client.get_url(path), json=body)
                self._current = i
                return reply
            except ConnectionTimeoutError:
                self._current = (i + 1) % n
                raise JournalUnavailable(
                    f"{where} did not answer within {self.timeout_s:g} s (no quorum, or stopped)"
                ) from None
            except ConnectionFailedError as e:
                why = f"{where}: {_reason(e) or 'connection refused'}"
            except Etcd3Exception as e:
                self._current = (i + 1) % n
                raise JournalUnavailable(f"{where} refused the request: {_reason(e)}") from None
        raise JournalUnavailable(why if n == 1 else f"no endpoint answers (last: {why})")

    def txn(
        self, compare: list[dict[str, Any]], success: list[Op], failure: list[Op]
    ) -> dict[str, Any]:
        """One transaction: ``success`` if every ``compare`` holds, else ``failure``."""
        return self.call("kv/txn", {"compare": compare, "success": success, "failure": failure})

    def get(self, key: str) -> KV | None:
        """The key-value at ``key``, or None."""
        kvs = self.call("kv/range", {"key": b64(key)}).get("kvs", [])
        return decode_kv(kvs[0]) if kvs else None

    def range_prefix(self, prefix: str, page: int = 500) -> list[KV]:
        """Every key under ``prefix``, in key order, read in pages at one revision."""
        return self.range_at(prefix, page)[0]

    def range_at(self, prefix: str, page: int = 500) -> tuple[list[KV], int]:
        """:meth:`range_prefix` and the store revision it was read at (a watch from the
        next revision misses nothing)."""
        out: list[KV] = []
        start, rev = b64(prefix), 0
        while True:
            body: dict[str, Any] = {"key": start, "range_end": after_prefix(prefix)}
            body["limit"] = str(page)
            if rev:
                body["revision"] = str(rev)
            reply = self.call("kv/range", body)
            rev = rev or revision(reply)
            kvs = [decode_kv(x) for x in reply.get("kvs", [])]
            out += kvs
            if not reply.get("more") or not kvs:
                return out, rev
            start = b64(kvs[-1]["key"] + b"\0")

    def grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; its id."""
        return int(self.call("lease/grant", {"TTL": str(ttl_s), "ID": "0"})["ID"])

    def keep_alive(self, lease: int) -> int:
        """Refresh a lease; its TTL left, or -1 when it has lapsed."""
        result = self.call("lease/keepalive", {"ID": str(lease)}).get("result", {})
        return int(result.get("TTL", -1))

    def revoke(self, lease: int) -> None:
        """Drop a lease and the keys attached to it."""
        self.call("kv/lease/revoke", {"ID": str(lease)})


TLS_REASONS = (
    (
        "CERTIFICATE_VERIFY_FAILED",
        "its TLS certificate is not trusted here: set controller.etcd_ca_file to the CA "
        "that signed it",
    ),
    (
        "WRONG_VERSION_NUMBER",
        "it does not speak TLS on that port: write the journal as etcd:// (or serve etcd "
        "over TLS there)",
    ),
    (
        "EOF occurred in violation of protocol",
        "it closed the TLS handshake: it wants a client certificate signed by a CA it "
        "trusts (controller.etcd_cert_file and controller.etcd_key_file)",
    ),
    (
        "alert",
        "it refused this controller's TLS client certificate: give one signed by a CA it "
        "trusts (controller.etcd_cert_file and controller.etcd_key_file)",
    ),
)
"""What a TLS failure means, by a mark in the SSL error's text (requests words them as a
chain of pool errors)."""


def _reason(e: Etcd3Exception) -> str:
    """etcd's one-line reason (its JSON ``error``), a TLS failure in words, else the
    exception's text."""
    import json

    text = e.detail_text or ""
    if "SSLError" in (text or str(e)):
        whole = text or str(e)
        return next((why for mark, why in TLS_REASONS if mark in whole), whole[:300])
    try:
        text = str(json.loads(text).get("error", text))
    except (ValueError, AttributeError):
        pass
    text = " ".join((text or str(e)).split())
    return text[:300]

"""Where the controller journals its state (``controller.journal``): ``"sqlite"``, the
embedded default (``journal.sqlite`` in the state dir), or an existing etcd cluster,
``etcd://host:port[,host:port...][/prefix]`` (``etcds://`` for one that speaks TLS:
``controller.etcd_ca_file``, and a client certificate with ``etcd_cert_file`` and
``etcd_key_file`` where etcd asks for one).

Checked when the config is read, so that a typo fails the job at once, in one line.
Whether the endpoints answer is checked when the controller starts
(:class:`phalanx.controller.journal.etcd.EtcdJournal`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

EXAMPLE = (
    '"sqlite" or "etcd://host:port[,host:port...][/prefix]" (e.g. etcd://127.0.0.1:2379; '
    "etcds:// for TLS)"
)
DEFAULT_PREFIX = "/phalanx"
"""The key prefix of an etcd journal without one in its URL is ``/phalanx/<job.id>``:
two jobs of different ids on one etcd keep apart by themselves."""

_HOST = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+)$")
_PREFIX = re.compile(r"^(/[A-Za-z0-9_.-]+)+$")


@dataclass(frozen=True)
class EtcdTarget:
    """An etcd journal's endpoints and key prefix."""

    endpoints: tuple[tuple[str, int], ...]
    """``(host, port)`` of each member given; an IPv6 host without brackets."""
    prefix: str | None
    """The key prefix from the URL; None: :data:`DEFAULT_PREFIX` ``/<job.id>``."""
    tls: bool = False
    """``etcds://``: HTTPS to every endpoint, the server's certificate verified."""
    ca_file: str | None = None
    """The CA that signed etcd's certificates (None: the trust store of ``requests``,
    certifi's or ``$REQUESTS_CA_BUNDLE``)."""
    cert_file: str | None = None
    """This controller's client certificate, for an etcd with ``--client-cert-auth``."""
    key_file: str | None = None

    @property
    def scheme(self) -> str:
        """``https`` or ``http``, for the gateway's URLs."""
        return "https" if self.tls else "http"

    def verify(self) -> str | bool:
        """``requests``' ``verify``: the CA file, or the system's trust store."""
        return self.ca_file or True

    def client_cert(self) -> tuple[str, str] | None:
        """``requests``' ``cert``: (certificate, key), or None."""
        return (self.cert_file, self.key_file) if self.cert_file and self.key_file else None

    def prefix_for(self, job_id: str) -> str:
        return self.prefix or f"{DEFAULT_PREFIX}/{job_id}"

    def url(self, prefix: str | None = None) -> str:
        """The URL, with ``prefix`` instead of the one given (if any)."""
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)
        return f"{'etcds' if self.tls else 'etcd'}://{hosts}{prefix or self.prefix or ''}"


def _bad(value: str, why: str) -> ValueError:
    return ValueError(f"controller.journal must be {EXAMPLE}: got {value!r}, {why}.")


def parse_etcd(value: str) -> EtcdTarget:
    """The endpoints and prefix of an ``etcd://`` journal URL, or a ValueError that says
    which part is wrong (pydantic turns it into the config's one-line error)."""
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in ("etcd", "etcds"):
        raise _bad(value, "which is neither sqlite nor an etcd:// or etcds:// URL")
    hosts, slash, path = rest.partition("/")
    prefix = f"/{path}".rstrip("/") if slash else ""
    if prefix and not _PREFIX.match(prefix):
        raise _bad(
            value,
            f"whose prefix {prefix!r} is not /name[/name...] of letters, digits, '_', '.', '-'",
        )
    if not hosts:
        raise _bad(value, "which names no host:port")
    endpoints = []
    for part in hosts.split(","):
        host, colon, port = part.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise _bad(value, f"whose endpoint {part!r} is not host:port (port 1..65535)")
        if not _HOST.match(host):
            raise _bad(value, f"whose host {host!r} is not a host name or address")
        endpoints.append((host.strip("[]"), int(port)))
    return EtcdTarget(tuple(endpoints), prefix or None, tls=scheme == "etcds")


def check_journal(value: str) -> str:
    """``value`` if it names a journal the controller can open, else a ValueError."""
    if value != "sqlite":
        parse_etcd(value)
    return value


def target_of(ctl: Any) -> EtcdTarget:
    """The etcd journal of a ``[controller]`` section: its URL and TLS files
    (``controller.etcd_*_file``)."""
    return dataclasses.replace(
        parse_etcd(ctl.journal),
        ca_file=ctl.etcd_ca_file,
        cert_file=ctl.etcd_cert_file,
        key_file=ctl.etcd_key_file,
    )

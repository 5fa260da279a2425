"""HTTPS for the controller, and where it says it listens.

Every request to the controller carries the job token, which lets its holder
register replicas, evict them and scale roles. On one machine the control plane
stays on loopback; across hosts it crosses a network, so the controller serves
HTTPS when given a certificate and key (``--tls-cert``/``--tls-key``), and says
in one line when it listens beyond this machine without it.

The files are checked here, before the controller binds or writes anything, so
that a wrong path or a key of another certificate is one line at the start, not
a traceback from inside the server.
"""

from __future__ import annotations

import ipaddress
import ssl
import sys

from phalanx.controller.statedir import CannotStart
from phalanx.net import AddressError, advertise_for_bind, hostport


def check_tls(cert: str | None, key: str | None) -> bool:
    """Whether the controller serves HTTPS: both files given (and usable), or
    neither. Raises :class:`CannotStart` in one line otherwise."""
    if cert is None and key is None:
        return False
    if cert is None or key is None:
        given, missing = ("--tls-cert", "--tls-key") if key is None else ("--tls-key", "--tls-cert")
        raise CannotStart(
            f"--tls-cert and --tls-key must be given together: got {given} without {missing}. "
            f"Pass both (the certificate and its private key, PEM), or neither for plain HTTP."
        )
    for flag, path in (("--tls-cert", cert), ("--tls-key", key)):
        try:
            with open(path, "rb"):
                pass
        except OSError as e:
            raise CannotStart(
                f"{flag} must be a readable PEM file: got {path!r} ({e.strerror or e})."
            ) from None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # No password: an encrypted key fails here instead of prompting on a terminal.
        ctx.load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as e:
        if e.reason == "KEY_VALUES_MISMATCH":
            raise CannotStart(
                f"--tls-key must be the private key of --tls-cert: got {key!r}, which does not "
                f"match the certificate in {cert!r}. Pass the key the certificate was made for."
            ) from None
        raise CannotStart(
            f"--tls-cert and --tls-key must be a PEM certificate and its unencrypted PEM "
            f"private key: got {cert!r} and {key!r} ({e.reason or e})."
        ) from None
    return True


def is_loopback(host: str) -> bool:
    """Whether an address (as a socket reports it) is on this machine only."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def clear_text_warning(host: str, tls: bool) -> str | None:
    """The one line to print when a controller bound to ``host`` takes the job token
    over plain HTTP from other machines; None when it does not."""
    if tls or is_loopback(host):
        return None
    return (
        f"phalanx controller: warning: --host {host} listens beyond this machine without "
        f"TLS, so the job token travels in clear text: pass --tls-cert and --tls-key (and "
        f"--ca-file to its clients), or bind 127.0.0.1."
    )


def warn_if_clear_text(host: str, tls: bool) -> None:
    line = clear_text_warning(host, tls)
    if line is not None:
        print(line, file=sys.stderr, flush=True)


def url_for(host: str, port: int, tls: bool) -> str:
    """The URL clients are given for a controller bound to ``host``:``port``. Bound to
    loopback, that address (the only one that reaches it). Otherwise the operator's
    advertised address, and for a wildcard bind with none named, this host's first
    routable address (:func:`phalanx.net.advertise_for_bind`). Clients check the
    certificate against the host of this URL, so with TLS it must be one the
    certificate names."""
    if not is_loopback(host):
        try:
            host = advertise_for_bind(host)
        except AddressError as e:
            raise CannotStart(str(e)) from None
    return f"{'https' if tls else 'http'}://{hostport(host, port)}"

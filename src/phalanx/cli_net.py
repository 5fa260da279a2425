"""The network options that several ``phalanx`` commands share: which controller,
its TLS files, the CA file clients trust, and the address this host advertises.

``--ca-file`` and ``--advertise-host`` set their environment variables
(:data:`phalanx.env.CA_FILE`, :data:`phalanx.env.ADVERTISE_HOST`) for the process,
so that everything it starts (replicas of a launcher, workers of an agent)
inherits them. Standard library only, like :mod:`phalanx.cli`: ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from phalanx import env


def add_controller(p: argparse.ArgumentParser) -> None:
    """``--controller`` and ``--ca-file``: for commands that talk to a controller."""
    p.add_argument(
        "--controller",
        help="controller URL, comma-separated URLs of several controllers (the leader is "
        "followed), or state dir ($PHALANX_CONTROLLER)",
    )
    add_ca_file(p)


def add_ca_file(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ca-file",
        metavar="PEM",
        help="CA certificates to verify an https:// controller with, for this process and "
        "the ones it starts ($PHALANX_CA_FILE; default: the system's CAs)",
    )


def add_tls(p: argparse.ArgumentParser) -> None:
    """``--tls-cert``/``--tls-key``: the controller serves HTTPS."""
    p.add_argument(
        "--tls-cert",
        metavar="PEM",
        help="serve HTTPS with this certificate (chain), which must name the host in the "
        "controller's URL; with --tls-key",
    )
    p.add_argument("--tls-key", metavar="PEM", help="the private key of --tls-cert")


def add_advertise_host(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--advertise-host",
        metavar="SPEC",
        help="the address other hosts reach this one at: an IP, a host name or iface:NAME "
        "($PHALANX_ADVERTISE_HOST; default loopback, or this host's first routable address "
        "for a controller bound to 0.0.0.0)",
    )


def controller_of(args: argparse.Namespace, command: str) -> str:
    """The controller a command talks to: ``--controller``, else $PHALANX_CONTROLLER."""
    controller = args.controller or os.environ.get(env.CONTROLLER)
    if not controller:
        raise SystemExit(
            f"phalanx {command}: --controller must name the controller (URL or state dir): got "
            f"none. Pass --controller or set ${env.CONTROLLER}."
        )
    return str(controller)


def check_advertised_bind(args: argparse.Namespace) -> None:
    """``phalanx controller``: an advertised address is one its clients connect to, so a
    controller listening on loopback alone cannot advertise another."""
    from phalanx.controller import is_loopback

    if args.advertise_host and is_loopback(args.host):
        raise SystemExit(
            f"phalanx controller: --advertise-host must be an address the controller listens "
            f"on: got {args.advertise_host!r} with --host {args.host}, which is this machine "
            f"only. Pass --host 0.0.0.0 (or this host's address) too."
        )


def run_controller_host(args: argparse.Namespace, tls: bool) -> str | None:
    """Where ``phalanx run`` binds its controller: the advertised address when one is
    named (the URL it writes is then one other hosts reach), else the default
    (loopback). Warns in one line when that takes the token off this machine in clear."""
    if not args.advertise_host:
        return None
    from phalanx.controller import warn_if_clear_text
    from phalanx.net import resolve

    host = resolve(args.advertise_host)
    warn_if_clear_text(host, tls)
    return host


def tls_files(args: argparse.Namespace, command: str) -> tuple[str, str] | None:
    """``--tls-cert``/``--tls-key`` as absolute paths, checked (both or neither, readable,
    the key of the certificate); raises SystemExit in one line otherwise."""
    from phalanx.controller import CannotStart, check_tls

    try:
        if not check_tls(args.tls_cert, args.tls_key):
            return None
    except CannotStart as e:
        raise SystemExit(f"phalanx {command}: {e}") from None
    return str(Path(args.tls_cert).resolve()), str(Path(args.tls_key).resolve())


def apply_env(args: argparse.Namespace, command: str) -> None:
    """Set the environment of ``--ca-file`` and ``--advertise-host``, each checked first
    (a CA file that cannot be read, an address that does not resolve: one line)."""
    ca_file = getattr(args, "ca_file", None)
    if ca_file:
        from phalanx.client.transport import ControllerError, verify_context

        os.environ[env.CA_FILE] = str(Path(ca_file).resolve())
        try:
            verify_context()
        except ControllerError as e:
            raise SystemExit(f"phalanx {command}: {e}") from None
    spec = getattr(args, "advertise_host", None)
    if spec:
        from phalanx.net import AddressError, resolve

        try:
            resolve(spec)
        except AddressError as e:
            raise SystemExit(f"phalanx {command}: --advertise-host: {e}") from None
        os.environ[env.ADVERTISE_HOST] = spec

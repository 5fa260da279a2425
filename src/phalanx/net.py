"""The addresses a process gives its peers (many hosts: DESIGN.md, defaults and
scale-out).

Every address a process advertises must be one its peers can reach: the
rendezvous store of a replica (heals, the weight-sync mesh), the address its
gloo process groups bind and announce, and the controller's URL. On one
machine all of that is loopback, the default. Across hosts the operator names
the address (``--advertise-host`` or :data:`phalanx.env.ADVERTISE_HOST`), as an
IP, a host name, or ``iface:NAME`` (the first IPv4 address of an interface),
because only the operator knows which network the peers share. A server bound
to every interface (``0.0.0.0``) with nothing named advertises the first
non-loopback IPv4 address of an interface that is up (:func:`routable_host`).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket

from phalanx import env

LOOPBACK = "127.0.0.1"
WILDCARDS = frozenset({"0.0.0.0", "::", ""})


class AddressError(ValueError):
    """An advertised address that cannot be used, said in one line."""


def interface_ipv4(name: str) -> str:
    """The first IPv4 address of interface ``name``."""
    import psutil

    addrs = psutil.net_if_addrs()
    if name not in addrs:
        raise AddressError(
            f"network interface {name!r} does not exist on this host: pick one of "
            f"{sorted(addrs)} for iface:NAME"
        )
    for a in addrs[name]:
        if a.family == socket.AF_INET:
            return str(a.address)
    raise AddressError(f"network interface {name!r} has no IPv4 address: pick another")


def routable_host() -> str:
    """The first IPv4 address, other than loopback, of an interface that is up;
    loopback when there is none (a host alone). Read from the interfaces: nothing
    is sent."""
    import psutil

    stats = psutil.net_if_stats()
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        if name in stats and not stats[name].isup:
            continue
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return str(a.address)
    return LOOPBACK


def resolve(spec: str) -> str:
    """An advertise spec (an IP, a host name, or ``iface:NAME``) as an address."""
    spec = spec.strip()
    if spec.startswith("iface:"):
        return interface_ipv4(spec.removeprefix("iface:"))
    if spec in WILDCARDS:
        raise AddressError(
            f"the advertised address must be one peers can connect to: got {spec!r} (a "
            "bind-everything address). Name this host's address or iface:NAME."
        )
    try:
        ipaddress.ip_address(spec.strip("[]"))
        return spec
    except ValueError:
        pass
    try:
        socket.getaddrinfo(spec, None)
    except OSError as e:
        raise AddressError(f"the advertised host {spec!r} does not resolve: {e}") from None
    return spec


def advertise_host() -> str:
    """The address this process gives its peers: the operator's
    (:data:`phalanx.env.ADVERTISE_HOST`), else loopback."""
    spec = os.environ.get(env.ADVERTISE_HOST, "")
    return resolve(spec) if spec else LOOPBACK


def advertise_for_bind(bind: str) -> str:
    """What a server bound to ``bind`` advertises: the operator's address if named,
    a wildcard bind's routable address, else the bound address itself."""
    if os.environ.get(env.ADVERTISE_HOST):
        return advertise_host()
    return routable_host() if bind in WILDCARDS else bind


def interface_of(address: str) -> str | None:
    """The network interface that holds IPv4 ``address`` on this host, or None."""
    import psutil

    for name, addrs in sorted(psutil.net_if_addrs().items()):
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


GLOO_IFNAME = "GLOO_SOCKET_IFNAME"
"""gloo's own variable: the interface(s) its default device binds."""


def pin_gloo_interface() -> None:
    """Call before a replica makes its own gloo groups (the default group, FSDP's).

    A replica whose ranks span hosts (torchrun's ``LOCAL_WORLD_SIZE`` below
    ``WORLD_SIZE``) must bind gloo to the advertised address: gloo's default device
    binds the address this host's name resolves to, which is loopback on many
    machines (and on hosts that share one name, as network namespaces do), and
    announces it to ranks on other hosts that cannot reach it there. So this sets
    ``GLOO_SOCKET_IFNAME`` to the interface of :func:`advertise_host`; one the
    operator set wins, and a replica on one host is left as it is. Raises
    :class:`AddressError` in one line when the advertised address is loopback or
    no interface's."""
    if os.environ.get(GLOO_IFNAME):
        return
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return  # env_ranks() says what is wrong with them
    if not 0 < local < world:
        return
    host = advertise_host()
    try:
        ip = socket.gethostbyname(host.strip("[]"))
    except OSError as e:
        raise AddressError(f"the advertised host {host!r} does not resolve: {e}") from None
    if ipaddress.ip_address(ip).is_loopback:
        raise AddressError(
            f"a replica whose ranks span hosts must advertise an address its other hosts "
            f"reach: got {host!r} (loopback). Set --advertise-host (or "
            f"${env.ADVERTISE_HOST}) to this host's address, or iface:NAME."
        )
    name = interface_of(ip)
    if name is None:
        raise AddressError(
            f"the advertised address {host!r} must be an address of this host: no "
            f"interface has {ip}. Set --advertise-host (or ${env.ADVERTISE_HOST}) to this "
            f"host's address, or iface:NAME."
        )
    os.environ[GLOO_IFNAME] = name


_HOSTPORT = re.compile(
    r"\[(?P<v6>[^\]]+)\](?::(?P<p6>\d+))?|(?P<host>[^:\[\]]+)(?::(?P<port>\d+))?"
)


def parse_hostport(spec: str, default_port: int, what: str) -> tuple[str, int]:
    """``HOST[:PORT]`` (an IPv6 host in brackets) as (host, port). Raises ValueError
    in one line naming ``what`` (the option) when it is not that."""
    m = _HOSTPORT.fullmatch(spec.strip())
    port = int((m.group("p6") or m.group("port") or default_port) if m else 0)
    if m is None or not 1 <= port <= 65535:
        raise ValueError(
            f"{what} must be HOST[:PORT] with a port from 1 to 65535: got {spec!r}. "
            f"Write e.g. {what} 10.0.0.1:{default_port}."
        )
    return m.group("v6") or m.group("host"), port


def free_port() -> int:
    """A loopback port the OS calls free now (another process may take it before it
    is bound: callers that start a server on it retry)."""
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


def hostport(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


PROBE_S = 0.25
"""How long a reachability probe waits for a TCP connection to a peer's address."""


def unreachable(
    addresses: dict[str, str], timeout_s: float = PROBE_S, refused: bool = True
) -> list[str]:
    """The keys of ``addresses`` (``host:port`` each) that refuse a TCP connection or
    do not answer within ``timeout_s``, probed at once. A partitioned peer drops the
    packets, a dead one refuses; a peer that is alive but stuck still connects (its
    kernel accepts), so this names only peers the network or death cuts off. With
    ``refused=False``, only the silent ones (a partition, not a death)."""
    from concurrent.futures import ThreadPoolExecutor

    def gone(addr: str) -> bool:
        host, _, port = addr.rpartition(":")
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
                return False
        except TimeoutError:
            return True
        except (OSError, ValueError):
            return refused

    if not addresses:
        return []
    with ThreadPoolExecutor(min(32, len(addresses)), thread_name_prefix="phalanx-probe") as pool:
        verdicts = dict(zip(addresses, pool.map(gone, addresses.values()), strict=True))
    return [k for k, v in verdicts.items() if v]


async def connect(address: str, timeout_s: float) -> None:
    """Open a TCP connection to ``address`` (``host:port``) and close it. Raises
    ConnectionRefusedError (nothing listens there), another OSError, TimeoutError
    (no answer in ``timeout_s``), or ValueError (not ``host:port``)."""
    import asyncio

    host, _, port = address.rpartition(":")
    _, writer = await asyncio.wait_for(
        asyncio.open_connection(host.strip("[]"), int(port)), timeout_s
    )
    writer.close()


def wait_for_most(addresses: dict[str, str], deadline: float, what: str) -> None:
    """Return once most of ``addresses`` answer (or refuse: dead, not cut off), probing
    every :data:`PROBE_S`; TimeoutError naming ``what`` at ``deadline`` (monotonic)."""
    import time

    while 2 * len(silent := unreachable(addresses, refused=False)) > len(addresses):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {len(silent)} of {len(addresses)} still do not answer")
        time.sleep(PROBE_S)

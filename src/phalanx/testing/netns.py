"""Hosts made of Linux network namespaces, for the multi-host tests (root only).

One namespace holds a bridge (the switch); each host is a namespace with
loopback and one veth port on the switch, with an address on a private /24
made for this test run (``10.213.K.0/24``). The test process itself gets a
port on the switch too (``.254``, in its own namespace), so that it can watch
the controller's status API; it sends nothing anywhere else.

Partitions are nftables rules inside a host's namespace (table ``inet
phalanx_cut``): packets to and from the cut addresses are dropped without a
reply, as a real partition does (no RST: open TCP connections just go
silent). ``loss`` drops a share of packets at random (``numgen random``). This
kernel has no ``netem`` qdisc, so there is no delay here.

Everything is removed by :meth:`Net.close`, even after a failure: the hosts'
namespaces (their veth ends go with them), then the switch's.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field

TABLE = "phalanx_cut"


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def unavailable() -> str | None:
    """Why network-namespace hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces as hosts need root"
    for tool in ("ip", "nft"):
        if _run("sh", "-c", f"command -v {tool}", check=False).returncode != 0:
            return f"{tool} is not installed (make install adds iproute2 and nftables)"
    probe = f"phxprobe{os.getpid()}"
    made = _run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    try:
        nft = _run("ip", "netns", "exec", probe, "nft", "add", "table", "inet", TABLE, check=False)
        if nft.returncode != 0:
            return f"nftables does not work in a namespace here: {nft.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


@dataclass
class Host:
    name: str
    ns: str
    ip: str
    cut_from: set[str] = field(default_factory=set)
    faults: bool = False
    """Whether this host's nftables table of faults exists (made once, until healed)."""

    def wrap(self, args: list[str]) -> list[str]:
        """``args`` run on this host (``ip netns exec`` execs it: the pid is the command's)."""
        return ["ip", "netns", "exec", self.ns, *args]

    def nft(self, *args: str) -> None:
        _run("ip", "netns", "exec", self.ns, "nft", *args)


class Net:
    """A switch and hosts on ``10.213.K.0/24`` (K from this process's pid, so that two
    test workers never share a subnet)."""

    def __init__(self) -> None:
        self.tag = f"{os.getpid() % 100000}"
        self.subnet = f"10.213.{20 + os.getpid() % 200}"
        self.switch = f"phx{self.tag}sw"
        self.hosts: dict[str, Host] = {}
        self._made: list[str] = []
        self.watcher = f"{self.subnet}.254"
        """The test process's own address on the switch (in namespace ``phx{tag}t``)."""
        _run("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        self._sw("ip", "link", "add", "br0", "type", "bridge")
        self._sw("ip", "link", "set", "br0", "up")

    def _sw(self, *args: str) -> None:
        _run("ip", "netns", "exec", self.switch, *args)

    def add_host(self, name: str) -> Host:
        """A new host: a namespace with loopback up and one address on the switch."""
        n = len(self.hosts) + 1
        ns, ip = f"phx{self.tag}{name}", f"{self.subnet}.{n}"
        _run("ip", "netns", "add", ns)
        self._made.append(ns)
        self._plug(ns, ip, n)
        _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        host = self.hosts[name] = Host(name, ns, ip)
        return host

    def _plug(self, ns: str, ip: str, n: int) -> None:
        here, there = f"pv{self.tag}h{n}", f"pv{self.tag}s{n}"  # (15 characters at most)
        _run("ip", "link", "add", here, "type", "veth", "peer", "name", there)
        _run("ip", "link", "set", here, "netns", ns)
        _run("ip", "link", "set", there, "netns", self.switch)
        self._sw("ip", "link", "set", there, "master", "br0")
        self._sw("ip", "link", "set", there, "up")
        _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", here)
        _run("ip", "netns", "exec", ns, "ip", "link", "set", here, "up")

    def watch_from_here(self) -> None:
        """Give the test process (the root namespace) a port on the switch, so that it
        can reach the hosts' addresses (and nothing else new)."""
        here, there = f"pv{self.tag}t", f"pv{self.tag}u"
        _run("ip", "link", "add", here, "type", "veth", "peer", "name", there)
        _run("ip", "link", "set", there, "netns", self.switch)
        self._sw("ip", "link", "set", there, "master", "br0")
        self._sw("ip", "link", "set", there, "up")
        _run("ip", "addr", "add", f"{self.watcher}/24", "dev", here)
        _run("ip", "link", "set", here, "up")
        self._watch_link = here

    # -- faults ----------------------------------------------------------

    def _table(self, h: Host) -> None:
        if h.faults:
            return
        h.faults = True
        h.nft("add", "table", "inet", TABLE)
        h.nft("add", "chain", "inet", TABLE, "out", "{ type filter hook output priority 0; }")
        h.nft("add", "chain", "inet", TABLE, "in", "{ type filter hook input priority 0; }")

    def cut(self, h: Host, others: list[Host]) -> None:
        """Drop every packet between ``h`` and ``others`` (both ways), silently."""
        self._table(h)
        for o in others:
            if o.ip in h.cut_from:
                continue
            h.nft("add", "rule", "inet", TABLE, "out", "ip", "daddr", o.ip, "drop")
            h.nft("add", "rule", "inet", TABLE, "in", "ip", "saddr", o.ip, "drop")
            h.cut_from.add(o.ip)

    def block_new(self, h: Host, others: list[Host]) -> None:
        """Drop the connections ``h`` opens to ``others`` (a firewall one way):
        connections they open to ``h`` still work."""
        self._table(h)
        for o in others:
            h.nft(
                "add",
                "rule",
                "inet",
                TABLE,
                "out",
                "ip",
                "daddr",
                o.ip,
                "ct",
                "state",
                "new",
                "drop",
            )

    def loss(self, h: Host, others: list[Host], percent: int) -> None:
        """Drop ``percent``% of the packets between ``h`` and ``others``, at random, each
        way (call it once per pair, or a packet meets two rules).

        Each packet is dropped where it arrives (the receiver's input hook), as a
        network loses it: the sender's TCP saw it leave, and retransmits it on its
        retransmission clock. A drop in the sender's own output hook is not a loss
        but a local send failure (``TCPRetransFail``), which TCP retries on its
        resource-probe timer (0.5 s and up, with backoff, whatever ``tcp_rto_min``):
        until 2026-11-26 this harness dropped there, and its loss runs had gaps of
        seconds with nothing in flight and the data unsent."""
        for x, y in [(h, o) for o in others] + [(o, h) for o in others]:
            self._table(x)
            x.nft(
                "add", "rule", "inet", TABLE, "in", "ip", "saddr", y.ip,
                "numgen", "random", "mod", "100", "<", str(percent), "drop",
            )  # fmt: skip

    def heal(self, h: Host) -> None:
        """Remove every fault of ``h``."""
        _run("ip", "netns", "exec", h.ns, "nft", "delete", "table", "inet", TABLE, check=False)
        h.cut_from.clear()
        h.faults = False

    def close(self) -> None:
        """Remove the hosts' namespaces and the switch (and with them every veth)."""
        link = getattr(self, "_watch_link", None)
        if link is not None:
            _run("ip", "link", "del", link, check=False)
        for ns in reversed(self._made):
            _run("ip", "netns", "del", ns, check=False)
        self._made.clear()

"""Liveness pings among the members of a process group: whether a collective that
runs past the collective timeout is slow or stuck.

Under packet loss a collective among live replicas can take longer than the
collective timeout: TCP sends a segment lost twice in a row again after 0.2 s and
0.4 s more, three times after 1.4 s. Giving the collective up then costs a new
quorum and a new full mesh of connections, whose lost SYNs wait 1 s each, and
the next collective is as likely to time out (issue 18: 10 to 29 s without a
commit at 20% loss). So a collective past its timeout is waited for while every
peer of its group still answers, as a member of that group, within
:data:`ALIVE_S`; it is given up at once when one does not (a peer hung, cut off,
or gone from the group: its answer says so) and at the patience at the latest.

Each process that serves a rendezvous store answers pings on UDP at the store's
port number (:func:`respond`); a communicator :func:`join` s a group while it
holds it and :func:`leave` s it when it drops it, and :func:`enter` s each
quorum round it takes with it. A ping names the group (a 16-byte digest of its
store and prefix); the answer says whether this process is in it, and the
latest round it took. A peer still at an older round than the waiting one's
has not been told of this step's quorum: it is not in the collective, and may
never be (cut off from the controller while its request was answered), so it
counts as silent. A stopped (SIGSTOP) or cut-off process does not answer, so
those are found as fast as before. Datagrams are fixed byte layouts, never
pickled.
"""

from __future__ import annotations

import hashlib
import logging
import socket
import struct
import threading
import time

log = logging.getLogger("phalanx.comm")

MAGIC = b"PXL2"
INTERVAL_S = 0.05
"""How often a waiting communicator pings each peer."""
ALIVE_S = 0.5
"""A peer counts as there if it answered as a member within this long (ten pings:
at 20% loss each way, all ten are lost about once in 30,000 checks)."""
_PING = struct.Struct("!4sIII16s")  # magic, watch generation, peer index, round, group
_PONG = struct.Struct("!4sIIIBQ")  # the ping's generation, index, round; member; quorum round

_lock = threading.Lock()
_groups: dict[bytes, int] = {}
"""The groups this process is in (digest -> holders: a process may hold a group
in more than one communicator)."""
_rounds: dict[bytes, int] = {}
"""The latest quorum round this process took with each group it is in."""


def digest(group: str) -> bytes:
    return hashlib.blake2b(group.encode(), digest_size=16).digest()


def join(group: str) -> None:
    """This process is in ``group`` from now on (its pings are answered "member")."""
    key = digest(group)
    with _lock:
        _groups[key] = _groups.get(key, 0) + 1


def leave(group: str) -> None:
    """This process dropped ``group``: its peers' pings are answered "not a member"."""
    key = digest(group)
    with _lock:
        n = _groups.get(key, 0) - 1
        if n > 0:
            _groups[key] = n
        else:
            _groups.pop(key, None)
            _rounds.pop(key, None)


def enter(group: str, round_: int) -> None:
    """This process took quorum round ``round_`` with ``group`` (it is in that step)."""
    key = digest(group)
    with _lock:
        if key in _groups:
            _rounds[key] = max(round_, _rounds.get(key, 0))


def member(key: bytes) -> tuple[bool, int]:
    """Whether this process is in the group, and the latest round it took with it."""
    with _lock:
        return key in _groups, _rounds.get(key, 0)


def _udp(port: int | None = None) -> socket.socket:
    """A UDP socket, dual-stack where the kernel has IPv6, else IPv4; bound on every
    interface at ``port`` if given."""
    try:
        s = socket.socket(socket.AF_INET6, socket.SOCK_DGRAM)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        if port is not None:
            s.bind(("::", port))
        return s
    except OSError:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        if port is not None:
            s.bind(("0.0.0.0", port))
        return s


class Responder:
    """Answers pings at UDP ``port`` on every interface, from a daemon thread."""

    def __init__(self, port: int):
        self.sock = _udp(port)
        self.port = port
        threading.Thread(target=self._serve, name="phalanx-liveness", daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                data, addr = self.sock.recvfrom(64)
            except OSError:
                return  # closed
            if len(data) != _PING.size or not data.startswith(MAGIC):
                continue
            _, gen, index, rnd, key = _PING.unpack(data)
            ok, at = member(key)
            try:
                self.sock.sendto(_PONG.pack(MAGIC, gen, index, rnd, ok, at), addr)
            except OSError:
                pass  # the peer's host is unreachable: it pings again

    def close(self) -> None:
        self.sock.close()


def respond(port: int) -> Responder | None:
    """Answer liveness pings at UDP ``port`` (a store's port number). None, with a
    warning, when that port is taken: peers then give this process's collectives
    up at the collective timeout, as without pings."""
    try:
        return Responder(port)
    except OSError as e:
        log.warning("liveness pings are not answered (UDP port %d: %s)", port, e)
        return None


def _sockaddr(address: str, family: int) -> tuple[str, int] | None:
    """Where to send ``host:port``'s pings from a socket of ``family``; None if it
    does not resolve (that peer then counts as silent)."""
    host, _, port = address.rpartition(":")
    try:
        info = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_DGRAM)
    except (OSError, ValueError):
        return None
    for fam, _, _, _, sa in info:
        if fam == socket.AF_INET:
            ip = str(sa[0])
            return (("::ffff:" + ip) if family == socket.AF_INET6 else ip, int(sa[1]))
        if fam == socket.AF_INET6 and family == socket.AF_INET6:
            return (str(sa[0]), int(sa[1]))
    return None


class Watch:
    """Pings the peers of one group while a collective waits (between :meth:`begin`
    and :meth:`end`), and says which of them did not answer as members lately
    (:meth:`silent`)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._gen = 0
        self._key = b""
        self._names: list[str] = []
        self._addrs: list[tuple[str, int] | None] = []
        self._last: list[tuple[float, bool, int, int]] = []
        """Per peer: when its last answer came, whether as a member, to which ping
        round, and the latest quorum round it took with the group."""
        self._at = 0
        """The quorum round this process took with the group (:meth:`at`)."""
        self._round = 0
        self._since = 0.0
        """Silence counts from here at the earliest: since pinging started, or since
        this process last ran again after it did not (:meth:`rearm`)."""
        self._waiting = 0
        self._sock = _udp()
        self._sock.settimeout(INTERVAL_S)
        self._started = False

    def set(self, group: str, peers: dict[str, str]) -> None:
        """Watch the peers (name -> ``host:port`` of their store) of ``group``."""
        addrs = [_sockaddr(a, self._sock.family) for a in peers.values()]
        with self._cv:
            self._gen += 1
            self._key, self._names, self._addrs = digest(group), list(peers), addrs
            self._last = [(float("-inf"), False, 0, 0)] * len(addrs)

    def clear(self) -> None:
        self.set("", {})

    def at(self, round_: int) -> None:
        """This process is in quorum round ``round_`` of the group watched: a peer
        that answers with an older one is not (yet) in this step's collectives."""
        with self._cv:
            self._at = round_

    def begin(self) -> None:
        with self._cv:
            if not self._started:
                self._started = True
                threading.Thread(target=self._run, name="phalanx-pings", daemon=True).start()
                threading.Thread(target=self._answers, name="phalanx-pongs", daemon=True).start()
            if self._waiting <= 0:
                self._since = time.monotonic()
            self._waiting += 1
            self._cv.notify_all()

    def rearm(self) -> None:
        """This process did not run for a while (stopped, starved of CPU): its pings
        were not sent and the answers not read, so silence counts from now."""
        with self._cv:
            self._since = time.monotonic()
            self._cv.notify_all()

    def end(self) -> None:
        with self._cv:
            self._waiting -= 1

    def silent(self) -> list[str]:
        """The peers that did not answer as members of the group within :data:`ALIVE_S`,
        or answer from an older quorum round than this process's (all of them when
        the group has none watched: nothing is known)."""
        now = time.monotonic()
        with self._cv:
            if not self._names:
                return ["(no peers watched)"]
            return [
                n
                for n, (t, ok, _, at) in zip(self._names, self._last, strict=True)
                if not ok or now - max(t, self._since) > ALIVE_S or at < self._at
            ]

    def _run(self) -> None:
        sock = self._sock
        while True:
            with self._cv:
                while self._waiting <= 0:
                    self._cv.wait()
                self._round += 1
                gen, key, addrs, rnd = self._gen, self._key, list(self._addrs), self._round
            for i, sa in enumerate(addrs):
                if sa is not None:
                    try:
                        sock.sendto(_PING.pack(MAGIC, gen, i, rnd, key), sa)
                    except OSError:
                        pass  # no route now: counts as no answer
            time.sleep(INTERVAL_S)

    def _answers(self) -> None:
        sock = self._sock
        while True:
            try:
                data = sock.recv(64)
            except TimeoutError:
                continue
            except OSError:
                return
            if len(data) != _PONG.size or not data.startswith(MAGIC):
                continue
            _, gen, i, rnd, ok, at = _PONG.unpack(data)
            with self._cv:
                if gen == self._gen and i < len(self._last) and rnd >= self._last[i][2]:
                    self._last[i] = (time.monotonic(), bool(ok), rnd, at)

"""The replica's cache of quorum member lists, keyed by their digest.

A quorum reply carries a brief (:class:`~phalanx.protocol.quorum.QuorumBrief`)
that names its member list by digest; :class:`MemberLists` turns it into the
:class:`~phalanx.protocol.quorum.QuorumView` the training layer reads. It
fetches a list (``POST /v1/quorum/members``) only when the digest is not one it
holds: once per change of membership, and then only the difference from the
list it held last (a peer joined or left: a few hundred bytes, whatever N).

Every list it keeps matched its digest when it came: a list that does not (a
controller of another phalanx version, a damaged reply) is refused in one line,
never used.
"""

from __future__ import annotations

from collections.abc import Callable

from phalanx.client.transport import ControllerError, Rejected, Transport
from phalanx.protocol.quorum import (
    MembersReply,
    MembersReq,
    QuorumBrief,
    QuorumPeer,
    QuorumView,
    members_of,
    roster_digest,
    view_of,
)

KEPT = 4
"""Member lists kept: the current one and a few before it (a quorum's id may go back
to an earlier list, as when a replica leaves and comes back)."""

Members = tuple[QuorumPeer, ...]


class DigestMismatch(ControllerError):
    """The member list the controller sent does not match the digest it gave."""


class MemberLists:
    """Used by :meth:`phalanx.client.ControllerClient.quorum`, from the one thread
    that asks for quorums. ``fetches`` counts the lists fetched (whole or as a
    difference), for tests and benchmarks."""

    def __init__(self, transport: Transport, log: Callable[..., None] | None = None):
        self.transport = transport
        self.lists: dict[str, Members] = {}
        """Digest -> member list, oldest first."""
        self.fetches = 0
        self.log = log

    def view(self, brief: QuorumBrief, me: str) -> QuorumView | None:
        """The quorum of ``brief`` (answered to replica ``me``), with its member list
        from the cache, fetched if need be. None when the controller no longer keeps
        that quorum (404) or holds other members under its id (409): ask for the
        quorum again. Raises :class:`DigestMismatch` for a list that does not match
        its digest."""
        members = self.lists.get(brief.digest)
        if members is None:
            try:
                members = self._fetch(brief)
            except Rejected as e:
                if e.status in (404, 409):
                    return None
                raise
        else:  # most recently used last: the list a difference is asked against
            del self.lists[brief.digest]
        self.lists[brief.digest] = members
        while len(self.lists) > KEPT:
            del self.lists[next(iter(self.lists))]
        if len(members) != brief.world_size or members[brief.rank].replica_id != me:
            raise DigestMismatch(
                f"quorum {brief.quorum_id} must hold this replica ({me}) at rank {brief.rank} "
                f"of {brief.world_size}: its member list (digest {brief.digest}) does not. "
                "Are the controller and this replica the same phalanx version?"
            )
        return view_of(brief, members, me)

    def _fetch(self, brief: QuorumBrief) -> Members:
        have = next(reversed(self.lists), None)
        members = self._ask(brief, have)
        if members is None and have is not None:
            members = self._ask(brief, None)  # the difference did not add up: all of it
        if members is None:
            raise DigestMismatch(
                f"the member list of quorum {brief.quorum_id} must match its digest "
                f"{brief.digest}: the controller's does not. Are the controller and this "
                "replica the same phalanx version?"
            )
        return members

    def _ask(self, brief: QuorumBrief, have: str | None) -> Members | None:
        req = MembersReq(role=brief.role, quorum_id=brief.quorum_id, digest=brief.digest, have=have)
        r = self.transport.call("/v1/quorum/members", req, MembersReply)
        self.fetches += 1
        base = self.lists.get(r.base) if r.base is not None else None
        if r.base is not None and base is None:
            return None
        members = members_of(r, base)
        if roster_digest(members) != brief.digest:
            if self.log is not None:
                self.log("member list of quorum %d does not match its digest", brief.quorum_id)
            return None
        return members

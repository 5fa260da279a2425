"""What a replica learns of a formed quorum: a brief each round, and the member
list once per change of membership.

A quorum's member list is O(N), and every member used to get all of it every
round: O(N) bytes per replica and O(N^2) per round in all. Now:

- each round, the quorum reply carries a :class:`QuorumBrief`: the quorum id,
  this replica's rank, the world size, the heals that concern it, and the
  :func:`roster_digest` of the member list. A few hundred bytes, whatever N;
- the member list itself (:class:`QuorumPeer` records) comes from
  ``POST /v1/quorum/members`` (:class:`MembersReq`), which a replica calls only
  when the brief names a digest it does not hold: once per change of
  membership. A replica that holds an older list names its digest (``have``)
  and gets only the difference (:class:`MembersReply`), so one replica joining
  a job of N costs each peer O(1) bytes, not O(N);
- the client puts the two together into a :class:`QuorumView`, what the
  training layer reads (:meth:`phalanx.client.ControllerClient.quorum`).

The member list of a ``quorum_id`` never changes (its id changes whenever its
members do; a member's name, address and size are fixed at registration), so
the digest names it across rounds, and across controller restarts.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Annotated, Protocol

from pydantic import Field

from phalanx.protocol.base import (
    Address,
    Count,
    Name,
    ReplicaId,
    Reply,
    RoleName,
    Wall,
    Wire,
)

MAX_MEMBERS = 100_000
"""Largest quorum the protocol carries."""

Digest = Annotated[str, Field(min_length=32, max_length=32, pattern=r"^[0-9a-f]{32}$")]
"""A member list's :func:`roster_digest`: 32 lowercase hex digits."""
Rank = Annotated[int, Field(ge=0, le=MAX_MEMBERS)]
FULL_SHARE = 1000
"""A share weight of an equal share: weights are in thousandths of one."""
Weight = Annotated[int, Field(ge=1, le=FULL_SHARE)]
Shares = Annotated[tuple[Weight, ...], Field(max_length=MAX_MEMBERS)]
"""Per-rank weights of the split of the global batch (:func:`phalanx.train.batch.
share_of`); empty: the equal split."""


class QuorumPeer(Wire):
    """One member of a quorum as its peers need it: who, where, how many ranks.
    Fixed for the member's whole incarnation."""

    replica_id: ReplicaId
    name: Name
    address: Address
    ranks: int = Field(ge=1, le=65536)
    tp: int = Field(1, ge=1, le=65536)
    """Its tensor-parallel degree (with ``ranks``, its layout)."""


class Peerlike(Protocol):
    """Whatever holds a member's identity (:class:`QuorumPeer`, or the controller's
    record of a quorum member)."""

    @property
    def replica_id(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def ranks(self) -> int: ...
    @property
    def tp(self) -> int: ...


def layout_of(ranks: int, tp: int = 1) -> str:
    """A replica's layout as errors name it: ``2 ranks``, or ``4 ranks (tp = 2)``."""
    return f"{ranks} ranks" if tp == 1 else f"{ranks} ranks (tp = {tp})"


def roster_digest(members: Iterable[Peerlike]) -> str:
    """The digest of a member list, in rank order (sorted by replica id): blake2b
    (16 bytes, hex) of its canonical JSON. Both sides compute it from the same
    values, so a replica can check the list it fetched against its brief."""
    canon = json.dumps(
        # (tp only where it is not 1: the digests of replicas without TP are as before)
        [
            [m.replica_id, m.name, m.address, m.ranks, *([m.tp] if m.tp != 1 else [])]
            for m in members
        ],
        separators=(",", ":"),
        ensure_ascii=True,
    )
    return hashlib.blake2b(canon.encode(), digest_size=16).hexdigest()


class QuorumHead(Wire):
    """What a brief and a view share, first in both (in this order)."""

    role: RoleName
    quorum_id: Count
    """Epoch of the membership: changes iff membership changes or a commit failed."""
    round: Count
    """Formation counter: one more for every quorum formed for this role."""
    max_step: Count
    formed_at: Wall
    job_step: Count = 0
    """As :attr:`phalanx.protocol.membership.Quorum.job_step`."""
    final_step: Count | None = None
    """As :attr:`phalanx.protocol.membership.Quorum.final_step`."""
    rolled_back_from: Count | None = None
    """As :attr:`phalanx.protocol.membership.Quorum.rolled_back_from`."""
    shares: Shares = ()
    """As :attr:`phalanx.protocol.membership.Quorum.shares`."""


class QuorumBrief(QuorumHead):
    """One replica's answer to its quorum request: the quorum, as far as this
    replica needs it each round. Encoded once per round for all members; only the
    last three fields differ between them (keep them last: the controller splices
    them into the round's shared bytes)."""

    world_size: int = Field(ge=1, le=MAX_MEMBERS)
    digest: Digest
    """:func:`roster_digest` of the quorum's member list."""
    rank: Rank
    """This replica's rank within the quorum (its index in the member list)."""
    heal_from: ReplicaId | None = None
    """The up-to-date member that heals this replica (None: it is up to date)."""
    heals: Annotated[tuple[ReplicaId, ...], Field(max_length=MAX_MEMBERS)] = ()
    """The lagging members this replica heals."""


class MembersReq(Wire):
    """Ask for the member list of a quorum the controller answered with ``digest``."""

    role: RoleName
    quorum_id: Count
    digest: Digest
    have: Digest | None = None
    """The digest of a member list this replica holds: the reply then carries only
    the difference from it, if the controller still knows it."""


class MembersReply(Reply):
    """A quorum's member list: all of it (``base`` None), or the difference from
    the list whose digest is ``base`` (the request's ``have``). The list is in rank
    order: sorted by replica id."""

    role: RoleName
    digest: Digest
    base: Digest | None = None
    members: Annotated[tuple[QuorumPeer, ...], Field(max_length=MAX_MEMBERS)]
    """The whole list (``base`` None), else the members ``base`` lacks."""
    removed: Annotated[tuple[ReplicaId, ...], Field(max_length=MAX_MEMBERS)] = ()
    """Members of ``base`` that are not in this list."""


def members_of(reply: MembersReply, base: tuple[QuorumPeer, ...] | None) -> tuple[QuorumPeer, ...]:
    """The member list ``reply`` gives: its ``members`` when whole, else ``base`` (the
    list of digest ``reply.base``, which the caller holds) with the difference
    applied, in rank order. The caller checks it against the digest it asked for."""
    if reply.base is None:
        return reply.members
    if base is None:
        raise ValueError(f"a difference from list {reply.base} needs that list")
    gone = set(reply.removed)
    kept = [m for m in base if m.replica_id not in gone]
    return tuple(sorted(kept + list(reply.members), key=lambda m: m.replica_id))


class QuorumView(QuorumHead):
    """A quorum as one replica holds it: its brief, with the member list from the
    client's cache. What :meth:`phalanx.client.ControllerClient.quorum` returns;
    JSON, so that a replica's rank 0 can hand it to its other ranks."""

    digest: Digest
    members: Annotated[tuple[QuorumPeer, ...], Field(max_length=MAX_MEMBERS)]
    """In rank order (sorted by replica id)."""
    heal: Annotated[dict[ReplicaId, ReplicaId], Field(max_length=MAX_MEMBERS)]
    """Lagging replica id -> the replica that heals it, for the heals that concern
    the replica that asked: its own source, and the replicas it heals."""

    @property
    def replica_ids(self) -> list[str]:
        return [m.replica_id for m in self.members]


def view_of(brief: QuorumBrief, members: tuple[QuorumPeer, ...], me: str) -> QuorumView:
    """Put ``brief`` (answered to replica ``me``) and its member list together."""
    heal = {lag: me for lag in brief.heals}
    if brief.heal_from is not None:
        heal[me] = brief.heal_from
    head = {k: getattr(brief, k) for k in QuorumHead.model_fields}
    return QuorumView.model_construct(**head, digest=brief.digest, members=members, heal=heal)

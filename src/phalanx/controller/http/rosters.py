"""The parts of the quorum replies that every member shares, built once and
served many times (:mod:`phalanx.protocol.quorum` has the protocol):

- a quorum's **roster**: its member list, the list's digest, each member's rank,
  and the encoded ``/v1/quorum/members`` reply, built once per ``quorum_id``
  (its members never change), and the difference from an earlier roster, built
  once per pair and sent to every member that held the earlier one;
- a round's **brief**: the N members of a round get replies that differ only in
  the rank and the heals that concern them. The round's reply is encoded once;
  a member with no heal gets those bytes with its rank spliced in, and only the
  few members that heal or are healed get a reply encoded of their own.

At N = 10,000 a round's N replies cost the controller 2 ms this way, against
150 ms encoded one by one (docs/benchmarks.md, "Controller").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from phalanx.controller.core.base import Conflict, StateError
from phalanx.controller.core.quorum import QUORUM_HISTORY
from phalanx.controller.core.state import ControllerState
from phalanx.protocol.membership import Quorum, QuorumReply
from phalanx.protocol.quorum import MembersReply, MembersReq, QuorumBrief, QuorumPeer, roster_digest

ROSTERS_KEPT = 16
"""Rosters kept (by quorum and by digest): a member list is served again from here
while any member may still fetch it, or fetch the difference from it."""
DELTAS_KEPT = 64
"""Encoded differences between two rosters kept."""
BRIEFS_KEPT = 32
"""Rounds whose encoded brief is kept."""

_TAIL = b',"heal_from":null,"heals":[]}}'
"""How a reply whose member neither heals nor is healed ends, after its rank."""


@dataclass
class Roster:
    role: str
    quorum_id: int
    digest: str
    peers: tuple[QuorumPeer, ...]
    rank_of: dict[str, int]
    body: bytes | None = None
    """The encoded full :class:`MembersReply` (built at the first fetch)."""


@dataclass
class RoundBrief:
    roster: Roster
    template: QuorumBrief
    """The round's brief, as rank 0 with no heals."""
    head: bytes | None
    """The encoded reply up to its rank's digits (None: encode each reply whole)."""
    heal: dict[str, str] = field(default_factory=dict)
    heals: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Healer -> the replicas it heals."""


def _put(cache: dict[Any, Any], key: Any, value: Any, kept: int) -> None:
    cache[key] = value
    while len(cache) > kept:
        del cache[next(iter(cache))]


class Rosters:
    """The caches of one controller process (encoded bytes carry its epoch). The
    quorum and members routes call it on the event loop; nothing here blocks."""

    def __init__(self, envelope: Callable[[], dict[str, Any]], encode: Callable[[Any], bytes]):
        self.envelope, self.encode = envelope, encode
        self.by_quorum: dict[tuple[str, int], Roster] = {}
        self.by_digest: dict[str, Roster] = {}
        self.deltas: dict[tuple[str, str], bytes] = {}
        self.briefs: dict[tuple[str, int, int], RoundBrief] = {}

    def roster(self, q: Quorum) -> Roster:
        key = (q.role, q.quorum_id)
        r = self.by_quorum.get(key)
        if r is None:
            peers = tuple(
                QuorumPeer.model_construct(
                    replica_id=m.replica_id, name=m.name, address=m.address, ranks=m.ranks, tp=m.tp
                )
                for m in q.members
            )
            rank_of = {m.replica_id: m.rank for m in q.members}
            r = Roster(q.role, q.quorum_id, roster_digest(peers), peers, rank_of)
            _put(self.by_quorum, key, r, ROSTERS_KEPT)
            _put(self.by_digest, r.digest, r, ROSTERS_KEPT)
        return r

    # -- the quorum reply --------------------------------------------------

    def reply(self, q: Quorum, replica_id: str) -> bytes:
        """The encoded ``ok`` reply to member ``replica_id`` of quorum ``q``."""
        key = (q.role, q.round, q.quorum_id)
        rb = self.briefs.get(key)
        if rb is None:
            rb = self._round(q)
            _put(self.briefs, key, rb, BRIEFS_KEPT)
        rank = rb.roster.rank_of[replica_id]
        heals = rb.heals.get(replica_id, ())
        heal_from = rb.heal.get(replica_id)
        if rb.head is not None and not heals and heal_from is None:
            return b"%s%d%s" % (rb.head, rank, _TAIL)
        brief = rb.template.model_copy(
            update={"rank": rank, "heal_from": heal_from, "heals": heals}
        )
        return self._encode_brief(brief)

    def _round(self, q: Quorum) -> RoundBrief:
        roster = self.roster(q)
        template = QuorumBrief.model_construct(
            role=q.role,
            quorum_id=q.quorum_id,
            round=q.round,
            max_step=q.max_step,
            formed_at=q.formed_at,
            job_step=q.job_step,
            final_step=q.final_step,
            rolled_back_from=q.rolled_back_from,
            shares=q.shares,
            world_size=len(q.members),
            digest=roster.digest,
            rank=0,
            heal_from=None,
            heals=(),
        )
        whole = self._encode_brief(template)
        end = b'"rank":0' + _TAIL
        # The splice relies on the brief's field order (rank, heal_from, heals last):
        # checked here against pydantic's own bytes, else every reply is encoded whole.
        head = whole[: -len(end) + len(b'"rank":')] if whole.endswith(end) else None
        heals: dict[str, list[str]] = {}
        for lag, healer in sorted(q.heal.items()):
            heals.setdefault(healer, []).append(lag)
        return RoundBrief(
            roster, template, head, dict(q.heal), {k: tuple(v) for k, v in heals.items()}
        )

    def _encode_brief(self, brief: QuorumBrief) -> bytes:
        return self.encode(
            QuorumReply.model_construct(**self.envelope(), status="ok", quorum=brief)
        )

    # -- the members route ---------------------------------------------------

    def members(self, st: ControllerState, req: MembersReq) -> tuple[bytes, str]:
        """The encoded member list of the quorum ``req`` names, or its difference
        from the list of digest ``req.have``, and which (``full`` or ``delta``). Raises 404 for a quorum the
        controller no longer keeps and 409 for one whose digest is not
        ``req.digest``: either way the replica asks for its quorum again."""
        rs = st.membership.role(req.role)
        r = self.by_quorum.get((req.role, req.quorum_id))
        if r is None:
            q = next((q for q in reversed(rs.quorums) if q.quorum_id == req.quorum_id), None)
            if q is None:
                raise StateError(
                    f"quorum_id must be of one of role {req.role}'s last {QUORUM_HISTORY} "
                    f"quorums: quorum {req.quorum_id} is not (the newest is {rs.quorum_id}). "
                    "Ask for the quorum again.",
                    field="quorum_id",
                    status=404,
                )
            r = self.roster(q)
        if r.digest != req.digest:
            raise Conflict(
                f"digest must be quorum {req.quorum_id}'s: got {req.digest}, its members' "
                f"is {r.digest}. Ask for the quorum again.",
                field="digest",
            )
        base = self.by_digest.get(req.have) if req.have not in (None, r.digest) else None
        if base is None:
            if r.body is None:
                r.body = self._encode_members(r, None, r.peers, ())
            return r.body, "full"
        key = (base.digest, r.digest)
        body = self.deltas.get(key)
        if body is None:
            added = tuple(p for p in r.peers if p.replica_id not in base.rank_of)
            removed = tuple(rid for rid in base.rank_of if rid not in r.rank_of)
            body = self._encode_members(r, base.digest, added, removed)
            _put(self.deltas, key, body, DELTAS_KEPT)
        return body, "delta"

    def _encode_members(
        self,
        r: Roster,
        base: str | None,
        members: tuple[QuorumPeer, ...],
        removed: tuple[str, ...],
    ) -> bytes:
        reply = MembersReply.model_construct(
            **self.envelope(),
            role=r.role,
            digest=r.digest,
            base=base,
            members=members,
            removed=removed,
        )
        return self.encode(reply)

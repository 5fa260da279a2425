"""The quorum reply is a brief whose size does not grow with N, spliced from one
encoding per round; the member list is served whole or as the difference from a
list the replica holds (:mod:`phalanx.controller.http.rosters`)."""

from __future__ import annotations

import pytest

from phalanx.config import load_config
from phalanx.controller.core.base import Conflict, StateError
from phalanx.controller.core.state import ControllerState
from phalanx.controller.http.base import encode
from phalanx.controller.http.rosters import Rosters
from phalanx.protocol.membership import Quorum, QuorumReply
from phalanx.protocol.quorum import (
    MembersReply,
    MembersReq,
    QuorumBrief,
    members_of,
    roster_digest,
    view_of,
)


def _state(n: int) -> ControllerState:
    cfg = load_config(
        overrides=[
            f"roles.policy.n_init_replicas={n}",
            "roles.policy.min_replicas=1",
            "roles.policy.join_timeout_s=60",
        ]
    )
    return ControllerState(cfg)


def _join(st: ControllerState, names: list[str]) -> list[str]:
    return [
        st.register("policy", name, "i0", now=0.0, wall=0.0, address=f"h:{i}")[0].replica_id
        for i, name in enumerate(names)
    ]


def _round(st: ControllerState, rids: list[str], steps: dict[str, int], r: int) -> Quorum:
    q = None
    for rid in rids:
        q, _ = st.request_quorum(rid, steps.get(rid, r), f"r{r}", 60.0, now=1.0, wall=1.0)
    assert q is not None
    return q


def _brief(rosters: Rosters, q: Quorum, rid: str) -> QuorumBrief:
    reply = QuorumReply.model_validate_json(rosters.reply(q, rid))
    assert reply.status == "ok" and reply.quorum is not None
    return reply.quorum


def test_the_quorum_reply_does_not_grow_with_n():
    sizes = {}
    for n in (10, 1000):
        st = _state(n)
        rids = _join(st, [f"r{i:04d}" for i in range(n)])
        q = _round(st, rids, {}, 0)
        rosters = Rosters(st.envelope, encode)
        last = rosters.reply(q, rids[-1])
        sizes[n] = len(last)
        for rank in (0, n // 2, n - 1):
            brief = _brief(rosters, q, rids[rank])
            assert (brief.rank, brief.world_size) == (rank, n)
            assert brief.digest == roster_digest(q.members)
    # The world size and the rank take a few more digits; nothing else changes.
    assert sizes[1000] - sizes[10] <= 6, sizes
    assert sizes[1000] < 400, sizes


def test_each_reply_is_what_pydantic_would_encode():
    """The round's bytes with a member's rank spliced in are that member's reply,
    and the few that heal or are healed get theirs encoded whole."""
    st = _state(3)
    a, b, c = _join(st, ["a", "b", "c"])
    _round(st, [a, b, c], {}, 0)
    q = _round(st, [a, b, c], {c: 0}, 5)  # c lags: a peer heals it
    assert q.heal == {c: a}
    rosters = Rosters(st.envelope, encode)
    for rank, rid in enumerate([a, b, c]):
        body = rosters.reply(q, rid)
        brief = _brief(rosters, q, rid)
        assert body == encode(QuorumReply(**st.envelope(), status="ok", quorum=brief))
        assert brief.rank == rank
    assert _brief(rosters, q, a).heals == (c,) and _brief(rosters, q, a).heal_from is None
    assert _brief(rosters, q, c).heal_from == a and _brief(rosters, q, b).heals == ()
    # What a replica builds from its brief: the heals that concern it.
    req = MembersReq(role="policy", quorum_id=q.quorum_id, digest=q_digest(q))
    members = MembersReply.model_validate_json(rosters.members(st, req)[0]).members
    assert view_of(_brief(rosters, q, a), members, a).heal == {c: a}
    assert view_of(_brief(rosters, q, b), members, b).heal == {}


def q_digest(q: Quorum) -> str:
    return roster_digest(q.members)


def test_a_member_list_is_served_whole_or_as_the_difference():
    st = _state(3)
    a, b, c = _join(st, ["a", "b", "c"])
    q1 = _round(st, [a, b, c], {}, 0)
    rosters = Rosters(st.envelope, encode)
    rosters.reply(q1, a)
    req = MembersReq(role="policy", quorum_id=q1.quorum_id, digest=q_digest(q1))
    body, kind = rosters.members(st, req)
    assert kind == "full"
    whole = MembersReply.model_validate_json(body)
    assert [m.replica_id for m in whole.members] == [a, b, c]
    assert members_of(whole, None) == whole.members

    # c leaves, d joins: the difference names one member out and one in.
    st.deregister(c, now=2.0, wall=2.0)
    (d,) = _join(st, ["d"])
    q2 = _round(st, [a, b, d], {}, 1)
    assert q2.quorum_id != q1.quorum_id
    req2 = MembersReq(role="policy", quorum_id=q2.quorum_id, digest=q_digest(q2), have=q_digest(q1))
    body2, kind2 = rosters.members(st, req2)
    delta = MembersReply.model_validate_json(body2)
    assert kind2 == "delta" and delta.base == q_digest(q1)
    assert ([m.replica_id for m in delta.members], delta.removed) == ([d], (c,))
    assert roster_digest(members_of(delta, whole.members)) == q_digest(q2)
    # Encoded once: every replica that held the old list gets the same bytes.
    assert rosters.members(st, req2)[0] is body2
    # A list it does not know to diff from: the whole list.
    unknown = req2.model_copy(update={"have": "0" * 32})
    assert rosters.members(st, unknown)[1] == "full"


def test_a_list_not_kept_or_of_another_digest_is_refused():
    st = _state(2)
    a, b = _join(st, ["a", "b"])
    q = _round(st, [a, b], {}, 0)
    rosters = Rosters(st.envelope, encode)
    with pytest.raises(StateError) as gone:
        rosters.members(st, MembersReq(role="policy", quorum_id=42, digest="0" * 32))
    assert (gone.value.status, gone.value.field) == (404, "quorum_id")
    with pytest.raises(Conflict) as other:
        rosters.members(st, MembersReq(role="policy", quorum_id=q.quorum_id, digest="0" * 32))
    assert (other.value.status, other.value.field) == (409, "digest")

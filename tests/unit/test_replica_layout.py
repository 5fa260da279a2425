"""One layout per job: a replica's ``[replica] ranks`` and ``tp`` are carried at
registration (the client's register, the controller's member record, the quorum's
members), so that a replica of another layout is refused by the controller, and a
quorum that holds one anyway (formed by an older controller) is refused by the
replica, each naming both layouts in one line. A client or a journal from before
``tp`` was carried means ``tp = 1``."""

from __future__ import annotations

import hashlib
import json

import pytest

from phalanx.config import load_config
from phalanx.controller.core.base import Conflict
from phalanx.controller.core.state import ControllerState
from phalanx.protocol.membership import QuorumMember, RegisterReq
from phalanx.protocol.quorum import QuorumPeer, QuorumView, roster_digest
from phalanx.train.hsdp import LayoutMismatch, check_layout


@pytest.fixture
def state() -> ControllerState:
    return ControllerState(load_config(overrides=["roles.policy.min_replicas=1"]))


def test_a_replica_of_the_same_ranks_but_another_tp_is_refused(state: ControllerState):
    a = state.register("policy", "a", "x", now=0, wall=0, ranks=2, tp=2)[0]
    assert a.tp == 2 and a.record()["tp"] == 2  # durable
    with pytest.raises(Conflict) as e:
        state.register("policy", "b", "x", now=1, wall=1, ranks=2, tp=1)
    said = str(e.value)
    assert "\n" not in said and e.value.field == "tp"
    assert (
        "this replica spans 2 ranks but role 'policy''s live replicas span 2 ranks (tp = 2)" in said
    )
    assert "[replica] ranks = 2, tp = 2" in said
    assert [m.replica_id for m in state.membership.alive("policy")] == [a.replica_id]
    # The same layout joins; a new incarnation of the same name may change it.
    state.register("policy", "c", "x", now=2, wall=2, ranks=2, tp=2)
    state.register("policy", "a", "y", now=3, wall=3, ranks=2, tp=2)
    assert {m.tp for m in state.membership.alive("policy")} == {2}


def test_a_member_record_or_a_register_without_tp_means_tp_1(state: ControllerState):
    m = state.register("policy", "a", "x", now=0, wall=0, ranks=2)[0]
    old = {k: v for k, v in m.record().items() if k != "tp"}  # a journal from before
    fresh = ControllerState(state.cfg)
    fresh.membership.restore({"members": {m.replica_id: old}}, now=0)
    assert fresh.membership.members[m.replica_id].tp == 1
    assert RegisterReq.model_validate({"role": "policy", "name": "a", "ranks": 2}).tp == 1
    member = {"replica_id": "a:x", "name": "a", "address": "", "ranks": 2, "step": 0, "rank": 0}
    assert QuorumMember.model_validate(member).tp == 1


def test_the_roster_digest_of_replicas_without_tp_is_as_before():
    peers = [QuorumPeer(replica_id="a:x", name="a", address="h:1", ranks=2)]
    before = json.dumps([["a:x", "a", "h:1", 2]], separators=(",", ":"), ensure_ascii=True)
    assert roster_digest(peers) == hashlib.blake2b(before.encode(), digest_size=16).hexdigest()
    tp = [QuorumPeer(replica_id="a:x", name="a", address="h:1", ranks=2, tp=2)]
    assert roster_digest(tp) != roster_digest(peers)


def _view(*layouts: tuple[int, int]) -> QuorumView:
    peers = tuple(
        QuorumPeer(replica_id=f"r{i}:x", name=f"r{i}", address="", ranks=r, tp=t)
        for i, (r, t) in enumerate(layouts)
    )
    head = {"role": "policy", "quorum_id": 1, "round": 1, "max_step": 0, "formed_at": 0.0}
    return QuorumView(**head, digest=roster_digest(peers), members=peers, heal={})


def test_a_quorum_of_another_layout_is_refused_by_the_replica_in_one_line():
    check_layout(_view((2, 2), (2, 2)), 2, 2)  # one layout: fine
    with pytest.raises(LayoutMismatch) as e:
        check_layout(_view((2, 2), (2, 1)), 2, 2)
    said = str(e.value)
    assert "\n" not in said
    assert (
        "this replica spans 2 ranks (tp = 2) but the quorum's other replicas span 2 ranks" in said
    )
    with pytest.raises(LayoutMismatch, match="span 4 ranks"):
        check_layout(_view((2, 1), (4, 1)), 2, 1)

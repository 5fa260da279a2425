"""A quorum reply is a brief, and a replica fetches the member list only when
membership changed (issue 36): real controller, real clients, counted on both
sides (the client's fetches, the controller's ``/metrics``)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from procs import wait_for

from phalanx.client import ControllerClient, DigestMismatch
from phalanx.protocol.quorum import QuorumBrief, QuorumView


def _round(clients: list[ControllerClient], step: int) -> list[QuorumView]:
    with ThreadPoolExecutor(len(clients)) as ex:
        return list(ex.map(lambda c: c.quorum(step, timeout_s=30), clients))


def _served(ctl) -> dict[str, int]:
    """Member lists the controller served, by kind (``full``, ``delta``)."""
    out = {}
    for line in ctl.get("/metrics").text.splitlines():
        if line.startswith("phalanx_quorum_member_lists_total{"):
            kind = line.split('kind="')[1].split('"')[0]
            out[kind] = int(float(line.split()[-1]))
    return out


@pytest.fixture
def clients():
    made: list[ControllerClient] = []

    def make(ctl, name: str) -> ControllerClient:
        c = ControllerClient(str(ctl.state_dir), "policy", name)
        c.start_heartbeat()
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


def test_members_are_fetched_once_per_change_of_membership(start_controller, clients):
    # join_timeout_s: every round waits for every live replica (no round cut short).
    ctl = start_controller(n_init=3, heartbeat_s=10.0, join_timeout_s=30.0)
    abc = [clients(ctl, n) for n in "abc"]
    for step in range(4):
        views = _round(abc, step)
    ids = sorted(c.replica_id or "" for c in abc)
    assert all(v.replica_ids == ids for v in views)
    assert {v.digest for v in views} == {views[0].digest}
    # Four rounds, one list each: fetched at the first, held since.
    assert [c.member_lists.fetches for c in abc] == [1, 1, 1]
    assert _served(ctl) == {"full": 3}

    # a's copy of the list goes bad: the difference it gets next cannot match the
    # digest, and it fetches the whole list instead of using a wrong one.
    a = abc[0]
    bad = a.member_lists.lists[views[0].digest]
    a.member_lists.lists[views[0].digest] = bad[1:]

    # d joins (it asks first, so that the round waits for it): the membership
    # changes once; a, b, c fetch the difference, d the whole list.
    d = clients(ctl, "d")
    with ThreadPoolExecutor(1) as ex:
        d_view = ex.submit(d.quorum, 0, 30)  # behind: a peer heals it
        wait_for(lambda: d.replica_id in ctl.status()["roles"]["policy"]["pending"], 10, "d asks")
        views = [*_round(abc, 4), d_view.result()]
    ids = sorted(c.replica_id or "" for c in [*abc, d])
    assert all(v.replica_ids == ids for v in views)
    assert all(v.members[i].replica_id == ids[i] for v in views for i in range(4))
    # The heals that concern each replica come with its brief: d's source, and the
    # replica it heals from (the others see none).
    source = views[3].heal[d.replica_id or ""]
    assert [v.heal for v in views] == [
        {d.replica_id: source} if c.replica_id in (source, d.replica_id) else {}
        for c, v in zip([*abc, d], views, strict=True)
    ]
    assert [c.member_lists.fetches for c in [*abc, d]] == [3, 2, 2, 1]
    assert _served(ctl) == {"full": 5, "delta": 3}

    # A replica whose cache lost the list fetches it again; nobody else does.
    b = abc[1]
    b.member_lists.lists.clear()
    _round([*abc, d], 5)
    assert [c.member_lists.fetches for c in [*abc, d]] == [3, 3, 2, 1]
    assert _served(ctl) == {"full": 6, "delta": 3}


def test_the_quorum_reply_is_a_brief(start_controller, clients):
    """What each replica gets per round: its rank and the list's digest, not the list."""
    ctl = start_controller(n_init=2, heartbeat_s=10.0, join_timeout_s=30.0)
    a, b = clients(ctl, "a"), clients(ctl, "b")
    _round([a, b], 0)

    def ask(c: ControllerClient):
        req = {"replica_id": c.replica_id, "step": 1, "request_id": "r1", "wait_s": 10}
        return ctl.post("/v1/quorum", req)

    with ThreadPoolExecutor(2) as ex:
        replies = list(ex.map(ask, [a, b]))
    ids = sorted([a.replica_id, b.replica_id])
    for c, r in zip([a, b], replies, strict=True):
        assert r.status_code == 200, r.text
        brief = r.json()["quorum"]
        assert "members" not in brief and len(r.content) < 400
        assert (brief["rank"], brief["world_size"]) == (ids.index(c.replica_id), 2)
    held = a.member_lists.lists[replies[0].json()["quorum"]["digest"]]
    assert [m.replica_id for m in held] == ids


def test_a_member_list_the_controller_does_not_hold_is_refused(start_controller, clients):
    ctl = start_controller(n_init=2, heartbeat_s=10.0, join_timeout_s=30.0)
    a, b = clients(ctl, "a"), clients(ctl, "b")
    view, _ = _round([a, b], 0)
    gone = ctl.post("/v1/quorum/members", {"role": "policy", "quorum_id": 99, "digest": "0" * 32})
    assert gone.status_code == 404, gone.text
    assert gone.json()["fields"][0]["field"] == "quorum_id"
    other = {"role": "policy", "quorum_id": view.quorum_id, "digest": "f" * 32}
    wrong = ctl.post("/v1/quorum/members", other)
    assert wrong.status_code == 409, wrong.text
    assert wrong.json()["fields"][0]["field"] == "digest"
    # A brief that does not agree with its list is refused in one line, never used.
    brief = QuorumBrief(
        role="policy",
        quorum_id=view.quorum_id,
        round=view.round,
        max_step=view.max_step,
        formed_at=view.formed_at,
        world_size=len(view.members),
        digest=view.digest,
        rank=view.replica_ids.index(a.replica_id or ""),
    )
    fresh = ControllerClient(str(ctl.state_dir), "policy", "reader")
    try:
        with pytest.raises(DigestMismatch, match="must hold this replica"):
            fresh.member_lists.view(brief, b.replica_id or "")
        assert fresh.member_lists.view(brief, a.replica_id or "") is not None
    finally:
        fresh.close(None)

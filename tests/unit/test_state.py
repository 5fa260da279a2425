"""The controller's pure state machine, driven by hand with a fake clock.

Every call takes ``now`` (monotonic seconds) and ``wall`` (for records);
the tests pass plain floats, so a clock jump is just a bigger number.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from phalanx.config import JobConfig, load_config
from phalanx.controller.core.base import Conflict, StateError, Tick, UnknownReplica
from phalanx.controller.core.quorum import QUORUM_HISTORY
from phalanx.controller.core.state import ControllerState
from phalanx.controller.journal import SqliteJournal as Journal
from phalanx.protocol.membership import Quorum

HEARTBEAT_S = 10.0
GRACE_S = 0.25
JOIN_S = 1.0


def make_cfg(**role: int | float) -> JobConfig:
    """Two roles; ``role`` overrides the policy role's quorum rules."""
    rules = {"min_replicas": 1, "n_init_replicas": 1, "join_timeout_s": JOIN_S, **role}
    return load_config(
        overrides=[
            f"timeouts.heartbeat_s={HEARTBEAT_S}",
            f"timeouts.suspect_grace_s={GRACE_S}",
            *(f"roles.policy.{k}={v}" for k, v in rules.items()),
            "roles.rollout.min_replicas=1",
        ]
    )


@pytest.fixture
def state() -> ControllerState:
    return ControllerState(make_cfg())


@pytest.fixture
def make_state() -> Callable[..., ControllerState]:
    return lambda **role: ControllerState(make_cfg(**role))


@pytest.fixture
def journal(tmp_path: Path):
    j = Journal(tmp_path / "journal.sqlite")
    yield j
    j.close()


def join(st: ControllerState, *names: str, now: float = 0.0, role: str = "policy") -> list[str]:
    return [st.register(role, n, "i0", now=now, wall=now)[0].replica_id for n in names]


def ask(
    st: ControllerState, rid: str, step: int = 0, *, now: float, req: str | None = None
) -> Quorum | None:
    q, _ = st.request_quorum(rid, step, req or f"{rid}@{now}", 60.0, now=now, wall=now)
    return q


def form(st: ControllerState, rids: list[str], *, now: float, step: int = 0) -> Quorum:
    """Every replica in ``rids`` asks at ``now``; the last ask must form the quorum."""
    for rid in rids[:-1]:
        assert ask(st, rid, step, now=now) is None
    q = ask(st, rids[-1], step, now=now)
    assert q is not None
    assert q.replica_ids == sorted(rids)
    return q


# -- membership -----------------------------------------------------------------


def test_register_adds_member(state):
    m, tick = state.register("policy", "a", "x1", now=1.0, wall=100.0, ranks=2, address="h:1")
    assert m.replica_id == "a:x1"
    assert (m.role, m.name, m.ranks, m.address, m.registered_at) == ("policy", "a", 2, "h:1", 100.0)
    assert tick == Tick()
    assert state.roles["policy"].member_ids == {"a:x1"}
    assert [x.replica_id for x in state.alive("policy")] == ["a:x1"]
    assert ("members", "a:x1", m.record()) in state.drain()
    assert state.log.changes == []


def test_reregister_evicts_old_incarnation(state):
    old = state.register("policy", "a", "x1", now=0, wall=0)[0].replica_id
    new, tick = state.register("policy", "a", "x2", now=1, wall=1)
    assert tick.evicted == [old]
    assert set(state.members) == {new.replica_id}
    assert state.events[-2]["reason"] == "replaced by a new incarnation"
    with pytest.raises(UnknownReplica) as e:
        state.heartbeat(old, now=2)
    assert e.value.status == 410


def test_reregister_drops_old_incarnations_request(make_state):
    st = make_state(join_timeout_s=100)
    a, b, _c = join(st, "a", "b", "c")
    assert ask(st, a, now=0) is None
    assert ask(st, b, now=0) is None
    _, tick = st.register("policy", "b", "i1", now=1, wall=1)
    assert tick.evicted == [b]
    assert set(st.roles["policy"].pending) == {a}
    assert tick.formed == []


def test_same_name_in_two_roles_coexists(state):
    a = state.register("policy", "a", "x", now=0, wall=0)[0]
    b = state.register("rollout", "a", "y", now=0, wall=0)[0]
    assert set(state.members) == {a.replica_id, b.replica_id}


def test_reused_incarnation_refused(state):
    state.register("policy", "a", "x", now=0, wall=0)
    state.drain()
    with pytest.raises(Conflict) as e:
        state.register("policy", "a", "x", now=1, wall=1)
    assert e.value.status == 409
    # Refused without side effects: the live incarnation is still there.
    assert set(state.members) == {"a:x"}
    assert state.drain() == []
    with pytest.raises(Conflict):
        state.register("rollout", "a", "x", now=1, wall=1)


def test_a_replica_of_another_size_than_the_live_ones_is_refused(state):
    a = state.register("policy", "a", "x", now=0, wall=0, ranks=2)[0].replica_id
    with pytest.raises(Conflict) as e:
        state.register("policy", "b", "x", now=1, wall=1, ranks=3)
    assert e.value.field == "ranks"
    assert "spans 3 ranks but role 'policy''s live replicas span 2" in str(e.value)
    assert "[replica] ranks = 2" in str(e.value)
    assert [m.replica_id for m in state.membership.alive("policy")] == [a]  # untouched
    # A new incarnation of the same name replaces the old one: its size may change.
    state.register("policy", "a", "y", now=2, wall=2, ranks=3)
    # With no live replica of the old size left, the new size is the job's.
    state.register("policy", "b", "x", now=3, wall=3, ranks=3)
    assert {m.ranks for m in state.membership.alive("policy")} == {3}
    # Another role's replicas are sized on their own.
    state.register("rollout", "r", "x", now=4, wall=4, ranks=1)


def test_register_unknown_role(state):
    with pytest.raises(StateError, match="role must be one of") as e:
        state.register("critic", "a", "x", now=0, wall=0)
    assert e.value.field == "role"
    assert e.value.status == 400


def test_deregister(state):
    (a,) = join(state, "a")
    tick = state.deregister(a, "done", now=1, wall=1)
    assert tick.evicted == [a]
    assert a not in state.members
    assert state.events[-1]["reason"] == "left: done"
    assert ("members", a, None) in state.drain()
    with pytest.raises(UnknownReplica):
        state.deregister(a, now=2, wall=2)


def test_deregister_completes_a_waiting_quorum(make_state):
    st = make_state(join_timeout_s=100)
    a, b, _c = join(st, "a", "b", "c")
    form(st, [a, b, _c], now=0)
    assert ask(st, a, now=1) is None
    assert ask(st, b, now=1) is None
    tick = st.deregister(_c, now=1, wall=1)
    assert [q.replica_ids for q in tick.formed] == [[a, b]]


def test_heartbeat_timeout_evicts(state):
    a, b = join(state, "a", "b")
    state.heartbeat(b, now=5.0)
    assert state.tick(now=HEARTBEAT_S - 0.01, wall=0).evicted == []
    tick = state.tick(now=HEARTBEAT_S, wall=0)
    assert tick.evicted == [a]
    assert set(state.members) == {b}
    assert state.events[-1]["reason"] == "heartbeat timeout"
    assert state.tick(now=5.0 + HEARTBEAT_S, wall=0).evicted == [b]


def test_large_clock_jump_evicts_everyone(state):
    join(state, "a", "b")
    join(state, "r", role="rollout")
    tick = state.tick(now=1e6, wall=0)
    assert sorted(tick.evicted) == ["a:i0", "b:i0", "r:i0"]
    assert state.members == {}


def test_heartbeat_raises_step_never_lowers_it(state):
    (a,) = join(state, "a")
    state.heartbeat(a, now=1, step=5)
    assert state.members[a].step == 5
    assert state.roles["policy"].step == 5
    state.heartbeat(a, now=2, step=3)
    assert state.members[a].step == 5
    assert state.roles["policy"].step == 5


def test_unknown_replica_everywhere(state):
    for call in (
        lambda: state.heartbeat("ghost:1", now=0),
        lambda: state.request_quorum("ghost:1", 0, "r", 1.0, now=0, wall=0),
        lambda: state.pending_commands("ghost:1"),
        lambda: state.ack("ghost:1", [1]),
        lambda: state.enqueue("ghost:1", "k", {}, now=0, wall=0),
        lambda: state.report_failure("ghost:1", [], now=0, wall=0),
    ):
        with pytest.raises(UnknownReplica):
            call()


# -- quorum formation -------------------------------------------------------------


def test_first_quorum_waits_for_n_init(make_state):
    st = make_state(min_replicas=1, n_init_replicas=2)
    (a,) = join(st, "a")
    assert ask(st, a, now=0) is None
    # Alone and past every timeout: still no first quorum.
    assert st.tick(now=JOIN_S * 5, wall=0).formed == []
    st.heartbeat(a, now=5)
    (b,) = join(st, "b", now=5)
    q = ask(st, b, now=5)
    assert q is not None
    assert q.replica_ids == [a, b]
    assert (q.quorum_id, q.round) == (1, 1)


def test_later_quorums_need_only_min_replicas(make_state):
    st = make_state(min_replicas=1, n_init_replicas=2)
    a, b = join(st, "a", "b")
    form(st, [a, b], now=0)
    st.deregister(b, now=1, wall=1)
    q = ask(st, a, now=1)
    assert q is not None
    assert q.replica_ids == [a]


def test_no_quorum_below_min_replicas(make_state):
    st = make_state(min_replicas=2, n_init_replicas=3)
    a, b, c = join(st, "a", "b", "c")
    form(st, [a, b, c], now=0)
    st.deregister(b, now=1, wall=1)
    st.deregister(c, now=1, wall=1)
    assert ask(st, a, now=1) is None
    assert st.tick(now=1 + JOIN_S * 5, wall=0).formed == []


def test_join_timeout_waits_for_stragglers(make_state):
    st = make_state(join_timeout_s=2.0)
    a, b, c = join(st, "a", "b", "c")
    assert ask(st, a, now=0.0) is None
    assert ask(st, b, now=0.5) is None  # 2 of 3: a quorum could form from now
    assert st.tick(now=2.49, wall=0).formed == []
    tick = st.tick(now=2.5, wall=0)  # join_timeout counts from b's ask
    assert [q.replica_ids for q in tick.formed] == [[a, b]]
    assert c not in tick.formed[0].replica_ids


def test_the_straggler_clock_starts_when_a_quorum_could_form(make_state):
    """Under packet loss the first finisher of an all-reduce may ask seconds before
    the others, which finish it together. Timed from its ask, the round formed at
    the second's ask and left the third, milliseconds behind, out: a new quorum
    without it, then another with it, each a new process group, and a heal
    (issue 18's 20%-loss runs). The majority's last ask starts the clock."""
    st = make_state(join_timeout_s=1.0)
    a, b, c = join(st, "a", "b", "c")
    q1 = form(st, [a, b, c], now=0)
    assert ask(st, a, 1, now=1.0) is None  # a finished the step first
    assert st.tick(now=3.0, wall=3.0).formed == []  # 1 of 3: no quorum yet
    assert ask(st, b, 1, now=3.5) is None  # 2 of 3, 2.5 s after the round began
    q2 = ask(st, c, 1, now=3.51)  # c, just behind b, is not left out
    assert q2 is not None and q2.replica_ids == sorted([a, b, c])
    assert q2.quorum_id == q1.quorum_id  # the same group: no new connections

    # A straggler that does not come is still left out, join_timeout_s later.
    assert ask(st, b, 2, now=4.0) is None
    assert ask(st, a, 2, now=6.0) is None
    assert st.tick(now=6.99, wall=7).formed == []
    (q3,) = st.tick(now=7.0, wall=7).formed
    assert q3.replica_ids == sorted([a, b])


def test_a_straggler_that_heartbeats_is_waited_for_as_long_as_a_collective(make_state):
    """Past join_timeout_s a member of the previous quorum that still heartbeats is
    in its step (under packet loss: in the all-reduce the askers finished first),
    and is waited for as long as a collective may last (collective_s or its
    patience); one that went silent (cut off from the controller) is not."""
    st = make_state(join_timeout_s=1.0)
    a, b, c = join(st, "a", "b", "c")
    q1 = form(st, [a, b, c], now=0)
    assert ask(st, a, 1, now=1.0) is None
    assert ask(st, b, 1, now=1.0) is None
    for t in (1.5, 2.5, 3.5, 4.5):
        for r in (a, b, c):
            st.heartbeat(r, now=t)
        assert st.tick(now=t + 0.4, wall=t).formed == []
    q2 = ask(st, c, 1, now=4.8)
    assert q2 is not None and q2.replica_ids == sorted([a, b, c])
    assert q2.quorum_id == q1.quorum_id

    # One that heartbeats and never asks (a main loop stuck, its heartbeat thread
    # alive) holds the round up to join_timeout_s + the collective patience (30 s).
    assert ask(st, a, 2, now=5.0) is None
    assert ask(st, b, 2, now=5.0) is None
    t = 5.0
    while t < 35.9:
        for r in (a, b, c):
            st.heartbeat(r, now=t)
        assert st.tick(now=t, wall=t).formed == [], t
        t += 0.5
    (q3,) = st.tick(now=36.0, wall=36.0).formed
    assert q3.replica_ids == sorted([a, b])

    # One that went silent is left out after join_timeout_s alone.
    st = make_state(join_timeout_s=1.0)
    a, b, c = join(st, "a", "b", "c")
    form(st, [a, b, c], now=0)
    assert ask(st, a, 1, now=1.5) is None
    assert ask(st, b, 1, now=1.5) is None
    assert st.tick(now=2.49, wall=2).formed == []
    (q,) = st.tick(now=2.5, wall=2.5).formed  # c last heard at 0
    assert q.replica_ids == sorted([a, b])


def test_everyone_alive_asking_forms_at_once(make_state):
    st = make_state(join_timeout_s=100)
    rids = join(st, "a", "b", "c")
    form(st, rids, now=0)


def test_fast_path_when_previous_quorum_reasks(make_state):
    st = make_state(join_timeout_s=100)
    a, b = join(st, "a", "b")
    q1 = form(st, [a, b], now=0)
    (c,) = join(st, "c", now=1)  # a new member that has not asked yet
    assert ask(st, a, now=1) is None
    q2 = ask(st, b, now=1)  # no join_timeout wait: the whole previous quorum is back
    assert q2 is not None
    assert q2.replica_ids == [a, b]
    assert q2.quorum_id == q1.quorum_id
    assert c not in q2.replica_ids


def test_no_fast_path_when_a_previous_member_is_gone(make_state):
    st = make_state(join_timeout_s=5)
    a, b, c, d = join(st, "a", "b", "c", "d")
    form(st, [a, b, c, d], now=0)
    st.deregister(d, now=1, wall=1)
    (e,) = join(st, "e", now=1)
    assert ask(st, a, now=1) is None
    assert ask(st, b, now=1) is None
    assert ask(st, c, now=1) is None
    assert st.tick(now=5.99, wall=0).formed == []
    assert [q.replica_ids for q in st.tick(now=6, wall=0).formed] == [[a, b, c]]
    assert e in st.members


def test_an_early_ask_does_not_start_the_straggler_clock(make_state):
    """A joiner (or a replica left out of the last round) that asks long before the
    previous quorum finishes its step must not make the next quorum form at the
    first finisher's ask: join_timeout counts from that first finisher. (Before,
    sync DiLoCo with a joiner formed every later round with 2 of 3 replicas.)"""
    st = make_state(join_timeout_s=1.0)
    a, b = join(st, "a", "b")
    form(st, [a, b], now=0)
    (c,) = join(st, "c", now=1)
    assert ask(st, c, now=1) is None  # early: a and b are still in their step
    assert st.tick(now=3, wall=3).formed == []  # no clock runs without a or b
    assert ask(st, b, 1, now=4) is None  # the round starts: b finished first
    assert st.tick(now=4.5, wall=4.5).formed == []
    q = ask(st, a, 1, now=4.6)  # a, just behind b, is not left out
    assert q is not None and q.replica_ids == sorted([a, b, c]) and q.heal == {c: a}

    # A previous member that does not come back is a straggler, timed from the first
    # ask of the previous quorum (c's, now that c was in it), and not before a
    # quorum could form (b's).
    assert ask(st, c, 2, now=5) is None
    assert ask(st, b, 2, now=5.5) is None  # and a quorum could form from b's ask
    assert st.tick(now=6.49, wall=6).formed == []
    # At 6.5 a was heard from within two heartbeat intervals (its ask at 4.6): still
    # in its step, it is waited for; silent since, it is left out.
    assert st.tick(now=6.5, wall=6.5).formed == []
    (q,) = st.tick(now=6.7, wall=6.7).formed
    assert q.replica_ids == sorted([b, c])


def test_joiners_form_alone_once_the_previous_quorum_is_gone(make_state):
    st = make_state(join_timeout_s=1.0)
    (a,) = join(st, "a")
    form(st, [a], now=0)
    b, c = join(st, "b", "c", now=1)
    assert ask(st, b, now=1) is None
    assert st.tick(now=5, wall=5).formed == []  # a is alive, in its step
    st.deregister(a, now=6, wall=6)  # gone: nobody of the previous quorum is left
    assert [q.replica_ids for q in st.tick(now=6, wall=6).formed] == []  # 1 of 2: no majority
    q = ask(st, c, now=6)  # everyone alive has asked
    assert q is not None and q.replica_ids == sorted([b, c])


def test_split_brain_guard_needs_majority_of_live(make_state):
    st = make_state(join_timeout_s=1.0)
    a, b, c, d = join(st, "a", "b", "c", "d")
    assert ask(st, a, now=0) is None
    assert ask(st, b, now=0) is None
    # Half of the live replicas is not a majority, however long they wait.
    for t in (1.0, 5.0, 9.0):
        st.heartbeat(c, now=t)
        st.heartbeat(d, now=t)
        assert st.tick(now=t, wall=0).formed == []
    # 3 of 4 is a majority: d gets join_timeout_s from c's ask, then is left out.
    st.heartbeat(a, now=9.0)
    st.heartbeat(b, now=9.0)
    assert ask(st, c, now=9.0) is None
    assert st.tick(now=9.99, wall=0).formed == []
    (q,) = st.tick(now=10.0, wall=0).formed
    assert q.replica_ids == [a, b, c]


def test_split_brain_guard_blocks_fast_path(make_state):
    st = make_state(join_timeout_s=1.0)
    (a,) = join(st, "a")
    form(st, [a], now=0)
    join(st, "b", "c", now=1)
    assert ask(st, a, now=1) is None  # the previous quorum ({a}) is back, but 1 of 3
    assert st.tick(now=5, wall=0).formed == []


def test_roles_form_independently(state):
    (p,) = join(state, "p")
    (r,) = join(state, "r", role="rollout")
    qp = ask(state, p, now=0)
    qr = ask(state, r, now=0)
    assert qp is not None and qr is not None
    assert (qp.role, qr.role) == ("policy", "rollout")
    assert qp.replica_ids == [p] and qr.replica_ids == [r]


def test_ranks_follow_sorted_replica_ids(make_state):
    st = make_state(join_timeout_s=100)
    rids = join(st, "c", "a", "b")
    q = form(st, rids, now=0)
    assert [(m.replica_id, m.rank) for m in q.members] == [("a:i0", 0), ("b:i0", 1), ("c:i0", 2)]


# -- quorum_id and round -----------------------------------------------------------


def test_quorum_id_stable_while_membership_stable(state):
    a, b = join(state, "a", "b")
    q1 = form(state, [a, b], now=0)
    q2 = form(state, [a, b], now=1, step=1)
    assert q2.quorum_id == q1.quorum_id
    assert q2.round == q1.round + 1


def test_quorum_id_changes_with_membership(state):
    a, b = join(state, "a", "b")
    q1 = form(state, [a, b], now=0)
    (c,) = join(state, "c", now=1)
    q2 = form(state, [c, a, b], now=1)  # c first, or a and b take the fast path
    state.deregister(c, now=2, wall=2)
    q3 = form(state, [a, b], now=2)
    assert q1.quorum_id < q2.quorum_id < q3.quorum_id
    assert [q1.round, q2.round, q3.round] == [1, 2, 3]


def test_quorum_id_changes_with_new_incarnation(state):
    a, b = join(state, "a", "b")
    q1 = form(state, [a, b], now=0)
    b2 = state.register("policy", "b", "i1", now=1, wall=1)[0].replica_id
    q2 = form(state, [a, b2], now=1)
    assert q2.quorum_id == q1.quorum_id + 1


def test_failed_commit_bumps_quorum_id_once(state):
    a, b = join(state, "a", "b")
    q1 = form(state, [a, b], now=0)
    unknown, tick = state.report_failure(a, [], now=1, wall=1, failed_commit=True)
    assert (unknown, tick) == ([], Tick())
    q2 = form(state, [a, b], now=1)
    q3 = form(state, [a, b], now=2)
    assert q2.replica_ids == q1.replica_ids
    assert q2.quorum_id == q1.quorum_id + 1
    assert q3.quorum_id == q2.quorum_id


def test_failure_report_without_failed_commit_keeps_quorum_id(state):
    a, b = join(state, "a", "b")
    q1 = form(state, [a, b], now=0)
    state.report_failure(a, [b], now=1, wall=1, reason="timeout")
    state.heartbeat(b, now=1.1)
    q2 = form(state, [a, b], now=1.2)
    assert q2.quorum_id == q1.quorum_id


def test_failed_commit_bumps_only_the_reporters_role(state):
    (p,) = join(state, "p")
    (r,) = join(state, "r", role="rollout")
    qp1, qr1 = ask(state, p, now=0), ask(state, r, now=0)
    state.report_failure(r, [], now=1, wall=1, failed_commit=True)
    qp2, qr2 = ask(state, p, now=1), ask(state, r, now=1)
    assert qp2.quorum_id == qp1.quorum_id
    assert qr2.quorum_id == qr1.quorum_id + 1


# -- steps and heal ------------------------------------------------------------------


def test_max_step_and_heal_round_robin(make_state):
    st = make_state(join_timeout_s=100)
    rids = join(st, "a", "b", "c", "d", "e", "f")
    steps = dict(zip(rids, [7, 3, 7, 1, 5, 0], strict=True))
    for rid in rids[:-1]:
        assert ask(st, rid, steps[rid], now=0) is None
    q = ask(st, rids[-1], steps[rids[-1]], now=0)
    assert q is not None
    assert q.max_step == 7
    # Lagging replicas (sorted) are spread over the up-to-date ones (sorted).
    assert q.heal == {"b:i0": "a:i0", "d:i0": "c:i0", "e:i0": "a:i0", "f:i0": "c:i0"}
    assert {m.replica_id: m.step for m in q.members} == steps
    assert st.roles["policy"].step == 7
    assert st.members["b:i0"].step == 3


def test_no_heal_when_everyone_is_current(state):
    a, b = join(state, "a", "b")
    q = form(state, [a, b], now=0, step=4)
    assert (q.max_step, q.heal) == (4, {})


# -- request idempotency and deadlines -------------------------------------------------


def test_retry_with_same_request_id_returns_same_quorum(state):
    a, b = join(state, "a", "b")
    assert ask(state, a, now=0, req="ra") is None
    q = ask(state, b, now=0, req="rb")
    state.drain()
    again, tick = state.request_quorum(a, 0, "ra", 60.0, now=1, wall=1)
    assert again == q
    assert tick == Tick()
    assert state.roles["policy"].pending == {}
    assert state.roles["policy"].round == 1
    assert state.drain() == []
    assert state.answer(b, "rb") == q
    assert state.answer(b, "other") is None


def test_retry_after_later_rounds_still_answers(state):
    (a,) = join(state, "a")
    q1 = ask(state, a, now=0, req="r1")
    ask(state, a, now=1, req="r2")
    # The last answered request id is what a retry is matched against.
    assert state.answer(a, "r2").round == 2
    assert state.answer(a, "r1") is None
    assert q1.round == 1


def test_answer_gone_after_history(state):
    (a,) = join(state, "a")
    for i in range(QUORUM_HISTORY + 2):
        ask(state, a, now=i, req=f"r{i}")
    assert len(state.roles["policy"].quorums) == QUORUM_HISTORY
    assert state.answer(a, f"r{QUORUM_HISTORY + 1}") is not None


def test_reasking_before_formation_replaces_request(make_state):
    st = make_state(join_timeout_s=100)
    a, b = join(st, "a", "b")
    assert ask(st, a, 1, now=0, req="first") is None
    assert ask(st, a, 2, now=1, req="second") is None
    q = ask(st, b, 2, now=1)
    assert st.answer(a, "second") == q
    assert st.answer(a, "first") is None


def test_stale_request_dropped_after_timeout(make_state):
    st = make_state(n_init_replicas=2)
    a, _b = join(st, "a", "b")
    st.request_quorum(a, 0, "r", 1.5, now=0, wall=0)
    st.tick(now=1.49, wall=0)
    assert set(st.roles["policy"].pending) == {a}
    st.tick(now=1.5, wall=0)
    assert st.roles["policy"].pending == {}
    assert st.roles["policy"].pending_since is None


def test_stale_request_not_used_by_a_formation_in_the_same_tick(make_state):
    # a gave up waiting (its request timed out) at the same tick that c is
    # evicted; the eviction must not form a quorum around a's dead request.
    st = make_state(join_timeout_s=100)
    a, b, c = join(st, "a", "b", "c")
    st.request_quorum(a, 0, "ra", 5.0, now=0, wall=0)
    st.request_quorum(b, 0, "rb", 60.0, now=0, wall=0)
    st.heartbeat(a, now=5)
    st.heartbeat(b, now=5)
    tick = st.tick(now=HEARTBEAT_S, wall=0)
    assert tick.evicted == [c]
    assert tick.formed == []
    assert set(st.roles["policy"].pending) == {b}


# -- failure reports ----------------------------------------------------------------


def test_suspect_evicted_after_grace(state):
    a, b, c = join(state, "a", "b", "c")
    unknown, tick = state.report_failure(a, [b], now=1.0, wall=1, reason="allreduce timeout")
    assert unknown == []
    assert tick.probe == [b]
    assert state.tick(now=1.0 + GRACE_S / 2, wall=0).evicted == []
    tick = state.tick(now=1.0 + GRACE_S, wall=0)
    assert tick.evicted == [b]
    assert state.events[-1]["reason"] == "failure report, no heartbeat in grace"
    assert set(state.members) == {a, c}


def test_false_report_does_not_evict_a_live_replica(state):
    a, b = join(state, "a", "b")
    state.report_failure(a, [b], now=1.0, wall=1)
    state.heartbeat(b, now=1.0 + GRACE_S / 2)
    assert state.members[b].suspect_since is None
    assert state.tick(now=1.0 + GRACE_S * 4, wall=0).evicted == []
    assert b in state.members


def test_repeated_report_does_not_extend_grace(state):
    # Five members: two reports of b are not a majority of its four peers.
    a, b, c, _, _ = join(state, "a", "b", "c", "d", "e")
    state.report_failure(a, [b], now=1.0, wall=1)
    _, tick = state.report_failure(c, [b], now=1.0 + GRACE_S / 2, wall=1)
    assert tick.probe == []  # already being probed
    assert state.tick(now=1.0 + GRACE_S, wall=0).evicted == [b]


def test_a_majority_of_its_peers_evicts_a_suspect_that_still_answers(state):
    """A partition between a replica and its peers, which the controller can still
    reach: its probe answers, but two of its two peers reported it."""
    a, b, c = join(state, "a", "b", "c")
    _, tick = state.report_failure(a, [c], now=1.0, wall=1)
    assert tick.probe == [c] and tick.evicted == []
    state.heartbeat(c, now=1.1, wall=1.1)  # it answers the probe...
    _, tick = state.report_failure(b, [c], now=1.2, wall=1.2)
    assert tick.evicted == [c]  # ...but most of its peers cannot reach it
    ev = next(e for e in state.events if e["kind"] == "evict")
    assert ev["detector"] == "failure_report" and "2 of its 2 peers" in ev["reason"]
    assert set(state.members) == {a, b}


@pytest.mark.parametrize("order", ["minority_first", "majority_first", "interleaved"])
def test_the_minority_side_of_a_partition_never_evicts_the_majority(state, order):
    """c is cut from a and b: a and b report c, c reports both. Whatever the order the
    reports arrive in, c is the one evicted (reports name only unreachable peers)."""
    a, b, c = join(state, "a", "b", "c")
    reports = {
        "minority_first": [(c, [a, b]), (a, [c]), (b, [c])],
        "majority_first": [(a, [c]), (b, [c]), (c, [a, b])],
        "interleaved": [(a, [c]), (c, [a, b]), (b, [c])],
    }[order]
    for i, (reporter, suspects) in enumerate(reports):
        if reporter in state.members:
            state.report_failure(reporter, suspects, now=1.0 + i / 100, wall=1)
            for rid in (a, b):  # the majority answers every probe
                if rid in state.members:
                    state.heartbeat(rid, now=1.0 + i / 100, wall=1)
    assert set(state.members) == {a, b}


@pytest.mark.parametrize("first", ["a", "c"])
@pytest.mark.parametrize("b_first", [True, False])
@pytest.mark.parametrize("probe_between", [False, True])
def test_survivors_of_a_hung_peer_that_report_everyone_are_not_cut_off(
    state, first, b_first, probe_between
):
    """b hangs in a collective (SIGSTOP: it reports nobody, and its port still accepts,
    so a and c cannot tell who failed and each reports both others). Once b is gone
    (most of its peers reported it, or its probe went unanswered before the second
    report came), what a and c said of each other is explained by b: whatever the
    order, b alone is evicted."""
    a, b, c = join(state, "a", "b", "c")
    reports = {a: [b, c] if b_first else [c, b], c: [b, a] if b_first else [a, b]}
    order = [a, c] if first == "a" else [c, a]
    evicted, t = [], 1.0
    for reporter in order:
        _, tick = state.report_failure(reporter, reports[reporter], now=t, wall=t)
        evicted += tick.evicted
        t += 0.001
        for rid in (a, c):  # the survivors answer every probe
            state.heartbeat(rid, now=t, wall=t)
        if probe_between:
            t += GRACE_S * 2  # b's probe goes unanswered before the second report
            for rid in (a, c):
                state.heartbeat(rid, now=t, wall=t)
            evicted += state.tick(now=t, wall=t).evicted
    evicted += state.tick(now=t + GRACE_S * 4, wall=t).evicted
    assert evicted == [b] and set(state.members) == {a, c}


def test_reports_older_than_the_heartbeat_timeout_do_not_count(state):
    a, b, c = join(state, "a", "b", "c")
    state.report_failure(a, [c], now=1.0, wall=1)
    for t in (1.1, 1.0 + HEARTBEAT_S / 2, 1.0 + HEARTBEAT_S - 0.1):
        for rid in (a, b, c):
            state.heartbeat(rid, now=t, wall=t)
    later = 1.0 + HEARTBEAT_S + 0.1
    _, tick = state.report_failure(b, [c], now=later, wall=later)
    assert tick.evicted == [] and tick.probe == [c]


def test_two_replicas_cut_from_each_other_leave_one_to_go_on(state):
    """With one peer, one report is never enough: the probe decides. Two replicas that
    report each other (a partition between them, both answering the controller):
    the first to report is evicted, and the other goes on."""
    a, b = join(state, "a", "b")
    _, tick = state.report_failure(a, [b], now=1.0, wall=1)
    assert tick.evicted == [] and tick.probe == [b]
    state.heartbeat(b, now=1.05, wall=1.05)
    _, tick = state.report_failure(b, [a], now=1.1, wall=1.1)
    assert tick.evicted == [a] and set(state.members) == {b}


def test_reporter_cannot_suspect_itself(state):
    a, b = join(state, "a", "b")
    with pytest.raises(StateError, match="reporter itself") as e:
        state.report_failure(a, [b, a], now=1, wall=1)
    assert e.value.field == "suspects"
    assert state.members[b].suspect_since is None


def test_unknown_suspects_returned(state):
    a, b = join(state, "a", "b")
    unknown, tick = state.report_failure(a, ["gone:1", b, "gone:1", "x:2"], now=1, wall=1)
    assert unknown == ["gone:1", "x:2"]
    assert tick.probe == [b]


def test_unknown_reporter(state):
    (a,) = join(state, "a")
    with pytest.raises(UnknownReplica) as e:
        state.report_failure("ghost:1", [a], now=1, wall=1)
    assert e.value.field == "reporter"


def test_report_is_recorded_as_event(state):
    a, b = join(state, "a", "b")
    state.report_failure(a, [b], now=1, wall=5, reason="x" * 500, failed_commit=True)
    ev = state.events[-1]
    assert (ev["kind"], ev["reporter"], ev["suspects"], ev["at"]) == ("failure_report", a, [b], 5)
    assert len(ev["reason"]) == 200
    assert ev["failed_commit"] is True


# -- commands ---------------------------------------------------------------------------


def test_enqueue_to_replica_and_ack(state):
    a, b = join(state, "a", "b")
    cmds, tick = state.enqueue(a, "checkpoint", {"step": 3}, now=0, wall=7)
    assert [(c.replica_id, c.kind, c.payload, c.created_at) for c in cmds] == [
        (a, "checkpoint", {"step": 3}, 7)
    ]
    assert tick.commands_for == {a}
    assert state.pending_commands(a) == cmds
    assert state.pending_commands(b) == []
    assert state.ack(a, [cmds[0].id]) == []
    assert state.pending_commands(a) == []


def test_enqueue_to_role(state):
    rids = join(state, "b", "a")
    join(state, "r", role="rollout")
    cmds, tick = state.enqueue("policy", "sync", {}, now=0, wall=0)
    assert [c.replica_id for c in cmds] == sorted(rids)
    assert tick.commands_for == set(rids)
    assert [c.id for c in cmds] == sorted(c.id for c in cmds)
    assert state.pending_commands("r:i0") == []


def test_enqueue_to_empty_role(state):
    cmds, tick = state.enqueue("rollout", "sync", {}, now=0, wall=0)
    assert cmds == []
    assert tick.commands_for == set()


def test_pending_commands_after_and_order(state):
    (a,) = join(state, "a")
    ids = [state.enqueue(a, f"k{i}", {"i": i}, now=0, wall=0)[0][0].id for i in range(4)]
    assert [c.id for c in state.pending_commands(a)] == ids
    assert [c.id for c in state.pending_commands(a, after=ids[1])] == ids[2:]


def test_ack_returns_unknown_ids(state):
    a, b = join(state, "a", "b")
    (c1,), _ = state.enqueue(a, "k", {}, now=0, wall=0)
    (c2,), _ = state.enqueue(b, "k", {}, now=0, wall=0)
    assert state.ack(a, [c1.id, c1.id, 999, c2.id]) == [c1.id, 999, c2.id]
    assert state.pending_commands(b) == [c2]  # b's command is not a's to ack


def test_payload_is_copied(state):
    (a,) = join(state, "a")
    payload = {"x": 1}
    (c,), _ = state.enqueue(a, "k", payload, now=0, wall=0)
    payload["x"] = 2
    assert c.payload == {"x": 1}


def test_eviction_drops_commands(state):
    (a,) = join(state, "a")
    (c,), _ = state.enqueue(a, "k", {}, now=0, wall=0)
    state.drain()
    state.deregister(a, now=1, wall=1)
    assert a not in state.commands.queues
    assert ("commands", f"{c.id:012d}", None) in state.drain()


# -- status -----------------------------------------------------------------------------


def test_status(state):
    a, b = join(state, "a", "b")
    form(state, [a, b], now=0, step=2)
    state.report_failure(a, [b], now=1, wall=1)
    s = state.status(now=3.0).model_dump(mode="json")
    pol = s["roles"]["policy"]
    assert (s["job_id"], s["epoch"]) == ("job", 0)
    assert (pol["quorum_id"], pol["round"], pol["step"]) == (1, 1, 2)
    assert pol["quorum"]["quorum_id"] == 1
    assert [r["replica_id"] for r in pol["replicas"]] == [a, b]
    assert [r["suspect"] for r in pol["replicas"]] == [False, True]
    assert pol["replicas"][0]["seconds_since_heartbeat"] == 3.0
    assert s["roles"]["rollout"]["quorum"] is None


def test_events_are_bounded(make_state):
    st = ControllerState(load_config(overrides=["controller.history=10"]))
    for i in range(30):
        st.register("policy", "a", f"i{i}", now=0, wall=0)
    assert len(st.events) == 10
    assert st.events[-1]["seq"] == st.event_seq


# -- durability: journal and restore ------------------------------------------------------


def restart(st: ControllerState, journal: Journal, *, now: float) -> ControllerState:
    journal.write(st.drain())
    new = ControllerState.restore(st.cfg, journal.load(), now)
    new.start(now, now)
    journal.write(new.drain())
    return new


def test_restore_from_journal(make_state, journal):
    st = make_state(join_timeout_s=100)
    st.start(0, 0)
    a, b, c = join(st, "a", "b", "c")
    (r,) = join(st, "r", role="rollout")
    q1 = form(st, [a, b, c], now=0, step=4)
    st.deregister(c, now=1, wall=1)
    q2 = form(st, [a, b], now=1, step=5)
    state_q_id, state_round = q2.quorum_id, q2.round
    (cmd,), _ = st.enqueue(a, "checkpoint", {"path": "x"}, now=1, wall=1)
    (acked,), _ = st.enqueue(b, "k", {}, now=1, wall=1)
    st.ack(b, [acked.id])
    st.heartbeat(r, now=1, step=2)
    before = {rid: m.record() for rid, m in st.members.items()}

    new = restart(st, journal, now=50.0)

    assert new.epoch == 2
    assert {rid: m.record() for rid, m in new.members.items()} == before
    assert all(m.last_seen == 50.0 for m in new.members.values())
    assert new.roles["policy"].member_ids == {a, b}
    assert new.roles["rollout"].member_ids == {r}
    pol = new.roles["policy"]
    assert (pol.quorum_id, pol.round, pol.step) == (state_q_id, state_round, 5)
    assert pol.last_quorum == q2
    assert [q.round for q in pol.quorums] == [q1.round, q2.round]
    assert pol.pending == {}
    assert new.pending_commands(a) == [cmd]
    assert new.pending_commands(b) == []
    assert new.commands.seq == st.commands.seq
    assert new.event_seq == st.event_seq + 1  # plus controller_start
    assert new.events[:-1] == st.events
    assert new.events[-1]["kind"] == "controller_start"
    # A request retried across the restart gets its answer back.
    assert new.answer(a, st.members[a].last_request_id) == q2
    # Nothing starts over: the next command id and quorum id move forward.
    (cmd2,), _ = new.enqueue(a, "k", {}, now=51, wall=51)
    assert cmd2.id > cmd.id
    q3 = form(new, [a, b], now=51, step=5)
    assert (q3.quorum_id, q3.round) == (q2.quorum_id, q2.round + 1)


def test_restore_gives_fresh_heartbeat_grace(state, journal):
    (a,) = join(state, "a")
    new = restart(state, journal, now=1000.0)
    assert new.tick(now=1000.0 + HEARTBEAT_S - 0.01, wall=0).evicted == []
    assert new.tick(now=1000.0 + HEARTBEAT_S, wall=0).evicted == [a]


def test_restore_forgets_suspicion(state, journal):
    a, b = join(state, "a", "b")
    state.report_failure(a, [b], now=1, wall=1)
    new = restart(state, journal, now=1.0)
    assert new.tick(now=1.0 + GRACE_S * 2, wall=0).evicted == []


def test_failed_commit_survives_restart(state, journal):
    a, b = join(state, "a", "b")
    q1 = form(state, [a, b], now=0)
    state.report_failure(a, [], now=1, wall=1, failed_commit=True)
    new = restart(state, journal, now=2)
    assert form(new, [a, b], now=2).quorum_id == q1.quorum_id + 1


def test_membership_change_across_restart_bumps(state, journal):
    a, b = join(state, "a", "b")
    q1 = form(state, [a, b], now=0)
    state.deregister(b, now=1, wall=1)
    new = restart(state, journal, now=2)
    q2 = ask(new, a, now=2)
    assert q2.quorum_id == q1.quorum_id + 1
    assert q2.round == q1.round + 1


def test_first_quorum_rule_after_restart(make_state, journal):
    st = make_state(n_init_replicas=2)
    (a,) = join(st, "a")
    new = restart(st, journal, now=1)
    assert ask(new, a, now=1) is None  # still the first quorum: needs 2
    (b,) = join(new, "b", now=1)
    assert ask(new, b, now=1).quorum_id == 1


def test_many_restarts_never_go_backwards(state, journal):
    (a,) = join(state, "a")
    last_id = last_round = last_step = 0
    st = state
    for i in range(5):
        if i % 2:
            st.report_failure(a, [], now=i, wall=i, failed_commit=True)
        q = ask(st, a, step=i, now=i)
        assert q.quorum_id >= last_id and q.round > last_round and q.max_step >= last_step
        last_id, last_round, last_step = q.quorum_id, q.round, q.max_step
        st = restart(st, journal, now=i + 0.5)
        pol = st.roles["policy"]
        assert (pol.quorum_id, pol.round, pol.step) == (last_id, last_round, last_step)
    assert st.epoch == 5


def test_restore_skips_roles_removed_from_config(state, journal):
    join(state, "p")
    (r,) = join(state, "r", role="rollout")
    state.enqueue(r, "k", {}, now=0, wall=0)
    journal.write(state.drain())
    cfg = load_config()  # policy only
    new = ControllerState.restore(cfg, journal.load(), now=0)
    assert set(new.members) == {"p:i0"}
    assert new.commands.queues == {}


def test_restore_from_empty_journal(journal):
    st = ControllerState.restore(make_cfg(), journal.load(), now=0)
    st.start(0, 0)
    assert (st.epoch, st.members, st.commands.seq) == (1, {}, 0)


def test_a_dropped_connection_makes_a_suspect_that_a_heartbeat_clears():
    from phalanx.config import JobConfig
    from phalanx.controller.core.state import ControllerState

    st = ControllerState(JobConfig())
    a, _ = st.register("policy", "a", "1", now=0.0, wall=0.0)
    b, _ = st.register("policy", "b", "1", now=0.0, wall=0.0)
    assert st.suspect(a.replica_id, "held connection dropped", now=1.0, wall=1.0).probe == [
        a.replica_id
    ]
    assert st.suspect(a.replica_id, "again", now=1.01, wall=1.0).probe == []  # already suspect
    st.heartbeat(b.replica_id, now=1.0)
    st.suspect(b.replica_id, "held connection dropped", now=1.0, wall=1.0)
    st.heartbeat(b.replica_id, now=1.1)  # alive: answered in the grace
    tick = st.tick(now=1.3, wall=1.3)
    assert tick.evicted == [a.replica_id]
    assert st.events[-1]["reason"] == "held connection dropped, no heartbeat in grace"
    assert b.replica_id in st.members


def test_a_suspect_whose_address_refuses_is_evicted_before_its_grace():
    st = ControllerState(JobConfig())
    a, _ = st.register("policy", "a", "1", now=0.0, wall=0.0, address="127.0.0.1:9")
    b, _ = st.register("policy", "b", "1", now=0.0, wall=0.0, address="127.0.0.1:10")
    assert st.refused(a.replica_id, now=0.5, wall=0.5).evicted == []  # not suspected: kept
    st.suspect(a.replica_id, "held connection dropped", now=1.0, wall=1.0)
    tick = st.refused(a.replica_id, now=1.01, wall=1.01)
    assert tick.evicted == [a.replica_id]
    ev = st.events[-1]
    assert ev["reason"] == "held connection dropped, address refused"
    assert (ev["detector"], ev["failed_at"]) == ("disconnect", 1.0)
    assert st.refused(a.replica_id, now=1.02, wall=1.02).evicted == []  # gone already
    st.suspect(b.replica_id, "failure report", now=2.0, wall=2.0)
    st.heartbeat(b.replica_id, now=2.1)  # answered: no longer suspected, a late refusal is moot
    assert st.refused(b.replica_id, now=2.2, wall=2.2).evicted == []
    assert b.replica_id in st.members


def test_checkpoints_are_recorded_bump_the_step_and_survive_restart(make_state, journal):
    from phalanx.controller.core.commands import CHECKPOINT_HISTORY

    st = make_state()
    st.start(0, 0)
    a, b = join(st, "a", "b")
    form(st, [a, b], now=0, step=3)
    # The saver knows of its commit before the controller (no quorum asked since).
    rec = st.record_checkpoint(a, 4, "s3://b/ck/step-000000004", 123, now=1, wall=1)
    assert rec.by == a and st.roles["policy"].step == 4
    for s in range(5, 5 + CHECKPOINT_HISTORY):
        st.record_checkpoint(b, s, f"file:///ck/step-{s:09d}", 1, now=2, wall=2)
    st.record_checkpoint(b, 6, "file:///ck/again", 2, now=3, wall=3)  # saved again: replaced
    status = st.status(3).model_dump(mode="json")["checkpoints"]
    assert status["latest"]["step"] == 4 + CHECKPOINT_HISTORY
    assert [c.step for c in st.checkpoints.records] == list(range(5, 5 + CHECKPOINT_HISTORY))
    assert next(c for c in st.checkpoints.records if c.step == 6).url == "file:///ck/again"
    assert st.events[-1]["kind"] == "checkpoint"
    new = restart(st, journal, now=10)
    assert new.checkpoints.records == st.checkpoints.records
    with pytest.raises(UnknownReplica):
        new.record_checkpoint("ghost:1", 9, "x", 0, now=11, wall=11)


def test_at_the_newest_step_only_the_newest_lineage_is_up_to_date(state):
    """a committed step 5 in quorum 3, which b and c did not follow (its collective
    finished, theirs timed out); they committed step 5 again in quorum 4. All three
    at step 5: a is healed from one of them, not taken as up to date."""
    a, b, c = join(state, "a", "b", "c")
    for rid, lineage in ((a, 3), (b, 4)):
        q, _ = state.request_quorum(rid, 5, f"{rid}-r", 60.0, now=1.0, wall=1, lineage=lineage)
        assert q is None
    q, _ = state.request_quorum(c, 5, f"{c}-r", 60.0, now=1.0, wall=1, lineage=4)
    assert q is not None and q.max_step == 5
    assert q.heal == {a: b}
    assert {m.replica_id: m.lineage for m in q.members} == {a: 3, b: 4, c: 4}


def test_a_quorum_waits_for_a_live_member_that_holds_a_newer_step(state):
    """c committed up to step 10 alone; a and b, back from a failure, ask at step 5.
    A quorum of a and b would redo steps 6..10 from older state (the job's steps
    going back): it waits for c, and a and b are healed from it."""
    a, b, c = join(state, "a", "b", "c")
    state.heartbeat(c, now=1.0, wall=1, step=10)
    ask(state, a, 5, now=1.0)
    assert ask(state, b, 5, now=1.0) is None
    late = 1.0 + HEARTBEAT_S / 2
    for rid in (a, b, c):
        state.heartbeat(rid, now=late, wall=late)
    assert state.tick(now=late, wall=late).formed == []  # past join_timeout_s, still waiting
    q = ask(state, c, 10, now=late)
    assert q is not None and q.max_step == 10 and set(q.heal) == {a, b}


def test_reports_never_evict_the_holder_of_the_newest_step(state):
    a, b, c = join(state, "a", "b", "c")
    state.heartbeat(c, now=1.0, wall=1, step=10)
    state.report_failure(a, [c], now=1.0, wall=1)
    _, tick = state.report_failure(b, [c], now=1.0, wall=1)
    assert tick.evicted == [] and c in state.members  # the probe decides


def test_rounds_do_not_wait_for_a_replica_its_peers_cut_off_until_it_asks(make_state):
    """c was evicted by its peers as unreachable; its new incarnation registers at once
    (it still reaches the controller) but asks for a quorum only once it reaches its
    peers again: a and b's rounds form at once meanwhile (no join_timeout_s wait),
    and it joins the round it asks in."""
    st = make_state(join_timeout_s=5)
    a, b, c = join(st, "a", "b", "c")
    form(st, [a, b, c], now=0)
    st.report_failure(a, [c], now=1, wall=1)
    assert st.report_failure(b, [c], now=1, wall=1)[1].evicted == [c]
    (c2,) = join(st, "c", now=1.1)
    q = form(st, [a, b], now=1.2)
    assert list(q.replica_ids) == [a, b]
    assert ask(st, c2, 0, now=2) is None
    ask(st, a, 1, now=2)
    q = ask(st, b, 1, now=2)
    assert q is not None and c2 in q.replica_ids and q.heal == {c2: a}

"""The job's step never goes back by accident (issue 34), in the pure state machine:
a round behind the role's step waits for a replica that holds it (a restarting
one whose checkpoint root can load it included), rolls back explicitly only
after ``timeouts.lost_step_wait_s``, and then refuses states of the abandoned
branch. Replicas of one role must share one checkpoint root. A replica behind a
finished job is answered at once and stops."""

from __future__ import annotations

import pytest

from phalanx.config import load_config
from phalanx.controller.core.base import Conflict
from phalanx.controller.core.state import ControllerState
from phalanx.protocol.membership import Quorum

WAIT_S = 5.0


HEARTBEAT_S = 10.0


def make(**more: str) -> ControllerState:
    cfg = load_config(
        overrides=[
            f"timeouts.heartbeat_s={HEARTBEAT_S}",
            "timeouts.quorum_s=2000",
            f"timeouts.lost_step_wait_s={WAIT_S}",
            "roles.policy.join_timeout_s=0",
            *(f"{k}={v}" for k, v in more.items()),
        ]
    )
    return ControllerState(cfg)


def join(st: ControllerState, name: str, *, now: float, step: int = 0, root: str = "") -> str:
    m, _ = st.register(
        "policy", name, f"i{now}", now=now, wall=now, step=step, state_root=root, root_id="x"
    )
    return m.replica_id


def ask(st: ControllerState, rid: str, step: int, *, now: float, lineage: int = 0) -> Quorum | None:
    q, _ = st.request_quorum(rid, step, f"{rid}@{now}", 60.0, now=now, wall=now, lineage=lineage)
    return q


def kinds(st: ControllerState, kind: str) -> list[dict]:
    return [e for e in st.events if e["kind"] == kind]


T = HEARTBEAT_S + 1
"""When :func:`at_nine`'s replica has been evicted."""


@pytest.fixture
def at_nine() -> tuple[ControllerState, str]:
    """A job whose policy committed 9 steps, then lost its only replica to a heartbeat
    timeout: stopped or cut off, it may come back with its state."""
    st = make()
    a = join(st, "a", now=0)
    assert ask(st, a, 9, now=0) is not None
    assert st.tick(now=T, wall=T).evicted == [a]
    return st, a


def test_a_round_behind_the_role_step_waits_then_rolls_back_explicitly(at_nine):
    st, _ = at_nine
    b = join(st, "b", now=T)
    # b resumed from an older checkpoint: its round waits for a replica with step 9.
    assert ask(st, b, 4, now=T) is None
    assert st.tick(now=T + WAIT_S - 0.1, wall=3).formed == []
    assert st.roles["policy"].step == 9 and kinds(st, "rollback") == []
    formed = st.tick(now=T + WAIT_S, wall=4).formed
    assert len(formed) == 1
    q = formed[0]
    assert (q.max_step, q.job_step, q.rolled_back_from) == (4, 4, 9)
    assert st.roles["policy"].step == 4
    (ev,) = kinds(st, "rollback")
    assert (ev["from_step"], ev["to_step"], ev["quorum_id"]) == (9, 4, q.quorum_id)
    assert ev["waited_s"] == pytest.approx(WAIT_S)
    assert st.status(now=10).roles["policy"].rollbacks[0].to_step == 4


def test_a_restarting_replica_whose_root_holds_the_step_is_waited_for(at_nine):
    st, _ = at_nine
    b = join(st, "b", now=T)
    assert ask(st, b, 4, now=T) is None
    # c registers saying its checkpoint root holds step 9: the round waits for it past
    # the wait, for as long as it is a member.
    c = join(st, "c", now=T + 1, step=9)
    later = T + 2 * WAIT_S
    st.heartbeat(b, now=later)
    assert st.tick(now=later, wall=5).formed == []
    q = ask(st, c, 9, now=later)
    assert q is not None and q.rolled_back_from is None
    assert q.max_step == 9 and q.heal == {b: c}
    assert kinds(st, "rollback") == [] and st.roles["policy"].step == 9


def test_states_of_the_abandoned_branch_are_refused(at_nine):
    st, _ = at_nine
    b = join(st, "b", now=T)
    assert ask(st, b, 4, now=T) is None
    (q,) = st.tick(now=T + WAIT_S, wall=4).formed
    # The old replica comes back holding step 9 of the branch that was rolled back:
    # it registers (its heartbeat could not know), but its quorum request is refused.
    a2 = join(st, "a", now=T + WAIT_S, step=9)
    with pytest.raises(Conflict, match="rolled the job back from step 9 to 4") as e:
        ask(st, a2, 9, now=T + WAIT_S, lineage=q.quorum_id - 1)
    assert e.value.field == "step"
    # A state at or below the step rolled back to is of the lineage, as is one
    # committed after the rollback.
    for step, lineage in ((4, q.quorum_id - 1), (3, 0), (7, q.quorum_id)):
        assert st.roles["policy"].orphaned(step, lineage) is None


def test_a_step_whose_holders_are_proven_gone_is_rolled_back_at_once():
    """The one replica that held step 9 was SIGKILLed (its address refused the
    controller's probe): nothing can bring step 9 back, since a restart reads the same
    root the waiting replica already read. No wait (a chaos-killed lone replica)."""
    st = make()
    a = join(st, "a", now=0)
    assert ask(st, a, 9, now=0) is not None
    st.suspect(a, "held connection dropped", now=1, wall=1)
    st.refused(a, now=1, wall=1)
    b = join(st, "b", now=2)
    q = ask(st, b, 4, now=2)
    assert q is not None and (q.rolled_back_from, q.max_step) == (9, 4)
    (ev,) = kinds(st, "rollback")
    assert ev["waited_s"] == 0


def test_a_replica_behind_a_finished_job_is_answered_at_once():
    st = make(**{"train.steps": "9"})
    a = join(st, "a", now=0)
    assert ask(st, a, 9, now=0) is not None
    st.deregister(a, "finished", now=1, wall=1)
    b = join(st, "b", now=2)
    q = ask(st, b, 4, now=2)
    assert q is not None and q.rolled_back_from is None
    assert (q.max_step, q.job_step, q.final_step) == (4, 9, 9)
    assert st.roles["policy"].step == 9 and kinds(st, "rollback") == []


def test_replicas_of_a_role_must_share_one_state_root():
    st = make()
    join(st, "a", now=0, root="/mnt/shared/ckpt")
    with pytest.raises(Conflict) as e:
        join(st, "b", now=1, root="/local/ckpt")
    assert e.value.field == "state_root"
    assert str(e.value).startswith(
        "policy replicas must share one state root: got /local/ckpt on b and /mnt/shared/ckpt on a."
    )
    with pytest.raises(Conflict, match="got none on c and /mnt/shared/ckpt on a"):
        join(st, "c", now=1)
    # The same path with another marker id: another host's disk behind one name.
    with pytest.raises(Conflict, match="is not the root a writes"):
        st.register("policy", "d", "i", now=1, wall=1, state_root="/mnt/shared/ckpt", root_id="y")
    # A new incarnation of the same name may bring another root (its old one leaves),
    # and a role with no live replica takes any.
    join(st, "a", now=2, root="/elsewhere")
    assert {m.state_root for m in st.alive("policy")} == {"/elsewhere"}


def test_rollbacks_survive_a_restart(at_nine, tmp_path):
    from phalanx.controller.journal import SqliteJournal as Journal

    st, _ = at_nine
    b = join(st, "b", now=T)
    ask(st, b, 4, now=T)
    (q,) = st.tick(now=T + WAIT_S, wall=4).formed
    j = Journal(tmp_path / "journal.sqlite")
    try:
        j.write(st.drain())
        back = ControllerState.restore(st.cfg, j.load(), now=100)
    finally:
        j.close()
    assert back.roles["policy"].rollbacks == st.roles["policy"].rollbacks
    assert back.roles["policy"].orphaned(9, q.quorum_id - 1) is not None

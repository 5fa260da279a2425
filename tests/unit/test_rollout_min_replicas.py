"""``roles.rollout.min_replicas`` at run time: below it the controller leases no
prompt; the rollout replicas there get empty replies (and any sync ordered) until
enough have registered again."""

from __future__ import annotations

from test_ledger import R1, R2, job, join, lease


def test_no_prompt_is_leased_below_the_rollout_roles_min_replicas():
    st = job("roles.rollout.min_replicas=2", "roles.rollout.n_init_replicas=2", rollouts=("r1",))
    assert lease(st, R1, 2)["lease"] is None  # 1 of 2 rollout replicas
    assert not st.ledger.prompts.leases
    join(st, "rollout", "r2", now=1)
    assert lease(st, R1, 2, now=1)["lease"] is not None  # 2 of 2
    assert lease(st, R2, 2, now=1)["lease"] is not None
    st.deregister(R2, "crashed", now=2, wall=2)  # below again: R1's next ask gets nothing
    assert lease(st, R1, 2, now=2)["lease"] is None


def test_the_default_min_replicas_leases_to_a_lone_replica():
    st = job(rollouts=("r1",))
    assert lease(st, R1, 2)["lease"] is not None

"""The job registry (phalanx.jobs): which loop ``phalanx replica`` runs for a job
config and a role, and the arguments each kind of process refuses, in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.config import load_config
from phalanx.jobs import JOBS, JobError, ReplicaArgs, job_kind, spec_for

FT = load_config()
RL = load_config(
    overrides=["rl.grpo.steps=1", "roles.policy.min_replicas=1", "roles.rollout.min_replicas=1"]
)
SYNC = load_config(overrides=["diloco.sync_every=2"])
SLOTS = load_config(overrides=["diloco.mode=objectstore", "diloco.url=file:///tmp/x"])
HSDP = load_config(overrides=["replica.ranks=2"])


@pytest.mark.parametrize(
    ("cfg", "role", "kind"),
    [
        (FT, "policy", "ft_ddp"),
        (RL, "policy", "rl_policy"),
        (RL, "rollout", "rl_rollout"),
        (SYNC, "policy", "diloco_sync"),
        (SLOTS, "policy", "diloco_slot"),
        (HSDP, "policy", "ft_hsdp"),
    ],
)
def test_each_job_config_and_role_has_its_loop(cfg, role, kind):
    assert job_kind(cfg, role) == kind
    args = ReplicaArgs(cfg, "r0", controller="http://127.0.0.1:1", role=role)
    assert spec_for(args) is JOBS[kind]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (ReplicaArgs(FT, "a", "c", role="rollout"), "Rollout replicas need an RL job"),
        (ReplicaArgs(FT, "a", "c", state=Path("s")), "--state is only for policy replicas"),
        (ReplicaArgs(SLOTS, "r0", state=Path("s")), "its state lives under diloco.url"),
        (ReplicaArgs(RL, "a", "c", role="rollout", out=Path("o")), "--out is not taken"),
        (ReplicaArgs(FT, "a"), "--controller must name the controller"),
    ],
)
def test_arguments_a_kind_does_not_take_are_refused_in_one_line(args, message):
    with pytest.raises(JobError, match=message) as e:
        spec_for(args)
    assert "\n" not in str(e.value)


def test_a_decoupled_slot_needs_no_controller():
    assert spec_for(ReplicaArgs(SLOTS, "r0")).kind == "diloco_slot"

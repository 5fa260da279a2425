"""``[rl]`` together with ``[diloco]`` (docs/architecture.md, "RL over DiLoCo"):
accepted with storage transports and whole rounds; anything else refused in one
line that names the setting and the fix."""

from __future__ import annotations

import pytest

from phalanx.config import ConfigError, load_config
from phalanx.jobs import job_kind

# 2 slots, H = 2: a round is 4 batches.
OK = [
    "roles.rollout.min_replicas=1",
    "roles.policy.min_replicas=2",
    "roles.policy.n_init_replicas=2",
    "rl.grpo.inner_epochs=1",
    "rl.grpo.steps=12",
    "rl.loop.sync_every=4",
    "rl.loop.max_staleness=8",
    "rl.transport.rollouts=file:///tmp/rl/rollouts",
    "rl.transport.weights=file:///tmp/rl/weights",
    "diloco.mode=objectstore",
    "diloco.url=file:///tmp/rl/diloco",
    "diloco.replicas=2",
    "diloco.min_replicas=2",
    "diloco.sync_every=2",
]


def job(*changes: str):
    keys = {c.split("=", 1)[0] for c in changes}
    return load_config(overrides=[o for o in OK if o.split("=", 1)[0] not in keys] + list(changes))


def test_rl_over_diloco_is_accepted_with_storage_transports():
    cfg = job()
    assert cfg.rl is not None and cfg.diloco is not None
    assert job_kind(cfg, "policy") == "rl_diloco" and job_kind(cfg, "rollout") == "rl_rollout"
    s3 = job("rl.transport.rollouts=s3://b/r", "rl.transport.weights=s3://b/w")
    assert s3.rl is not None and s3.rl.transport.weights == "s3://b/w"


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (
            "rl.transport.rollouts=controller",
            "rl.transport.rollouts must be a storage URL (file:///path, s3://bucket/prefix) "
            "with [diloco]: got 'controller'.",
        ),
        (
            "rl.transport.weights=collective",
            "rl.transport.weights must be a storage URL (file:///path, s3://bucket/prefix) "
            "with [diloco]: got 'collective'.",
        ),
        ("diloco.mode=sync", 'diloco.mode must be "objectstore" in an RL job'),
        ("diloco.fragments=2", "diloco.fragments must be 1 and diloco.tau 0 in an RL job"),
        ("diloco.min_replicas=1", "diloco.min_replicas and roles.policy.min_replicas must equal"),
        ("rl.grpo.inner_epochs=2", "rl.grpo.inner_epochs must be 1 with [diloco]: got 2."),
        ("rl.grpo.steps=10", "rl.grpo.steps must be a multiple of diloco.sync_every x"),
        ("rl.loop.sync_every=2", "rl.loop.sync_every must be a multiple of diloco.sync_every x"),
        ("rl.loop.max_staleness=3", "rl.loop.max_staleness must be >= 4 (the batches of one"),
    ],
)
def test_what_rl_over_diloco_cannot_honour_is_refused_in_one_line(change: str, says: str):
    with pytest.raises(ConfigError) as e:
        job(change)
    header, error = str(e.value).split(": ", 1)
    assert header.startswith("invalid job config") and "\n" not in error, error
    fix = error.lower()
    assert says in error and ("set " in fix or "pass " in fix), error

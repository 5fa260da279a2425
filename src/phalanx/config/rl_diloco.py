"""What an RL job over decoupled DiLoCo (``[rl]`` with ``[diloco]``) must set, checked
at load (docs/architecture.md, "RL over DiLoCo").

The policy replicas are DiLoCo slots that share nothing but storage and the
controller's small messages: rollouts and weights must travel through storage,
each inner step trains a batch of its own, and the job's batches, syncs and
staleness are counted in whole rounds of ``H·S`` batches (H =
``diloco.sync_every``, S = ``diloco.replicas``). Every slot takes part in every
round (a slot that dies is waited for: its batches stay frozen for it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from phalanx.config.job import RoleSection
    from phalanx.config.rl import RLConfig
    from phalanx.config.train import DiLoCoSection


def _storage(url: str) -> bool:
    """A storage URL (``rl.transport`` checked it can store), not a keyword or Redis."""
    return "://" in url and not url.startswith(("redis://", "rediss://"))


def round_batches(dc: DiLoCoSection) -> int:
    """Batches of one outer round, ``H·S``: the step between two versions."""
    return dc.sync_every * dc.replicas


def check_rl_diloco(rl: RLConfig, dc: DiLoCoSection, policy: RoleSection) -> None:
    """Raise ValueError (one line: the setting, what it got, the fix) where the job's
    settings do not fit RL over decoupled DiLoCo."""
    t = rl.transport
    if not _storage(t.rollouts):
        raise ValueError(
            f"rl.transport.rollouts must be a storage URL (file:///path, s3://bucket/prefix) "
            f"with [diloco]: got {t.rollouts!r}. The policy slots share nothing but storage "
            f'and the controller\'s small messages; set rl.transport.rollouts = "file:///...".'
        )
    if not _storage(t.weights):
        raise ValueError(
            f"rl.transport.weights must be a storage URL (file:///path, s3://bucket/prefix) "
            f"with [diloco]: got {t.weights!r}. No network path joins the policy slots and "
            f'the rollout replicas; set rl.transport.weights = "file:///...".'
        )
    if dc.mode != "objectstore":
        raise ValueError(
            f'diloco.mode must be "objectstore" in an RL job: got {dc.mode!r}. The policy '
            'slots exchange through storage; set diloco.mode = "objectstore".'
        )
    if dc.fragments != 1 or dc.tau != 0:
        raise ValueError(
            f"diloco.fragments must be 1 and diloco.tau 0 in an RL job: got fragments="
            f"{dc.fragments}, tau={dc.tau}. A version is θ_global after a whole round; set "
            "diloco.fragments = 1 and diloco.tau = 0."
        )
    if not dc.min_replicas == policy.min_replicas == dc.replicas:
        raise ValueError(
            f"diloco.min_replicas and roles.policy.min_replicas must equal diloco.replicas in "
            f"an RL job: got {dc.min_replicas}, {policy.min_replicas} and {dc.replicas}. Every "
            f"slot trains its own batches in every round; set both to {dc.replicas}."
        )
    g, loop, n = rl.grpo, rl.loop, round_batches(dc)
    if g.inner_epochs != 1:
        raise ValueError(
            f"rl.grpo.inner_epochs must be 1 with [diloco]: got {g.inner_epochs}. Each inner "
            f"step trains a batch of its own; set rl.grpo.inner_epochs = 1."
        )
    for name, value in (("rl.grpo.steps", g.steps), ("rl.loop.sync_every", loop.sync_every)):
        if value % n:
            raise ValueError(
                f"{name} must be a multiple of diloco.sync_every x diloco.replicas = {n} "
                f"(the batches of one round) with [diloco]: got {value}. Set {name} to a "
                f"multiple of {n}."
            )
    if loop.max_staleness < n:
        raise ValueError(
            f"rl.loop.max_staleness must be >= {n} (the batches of one round) with [diloco]: "
            f"got {loop.max_staleness}. A round's last batch is {n - 1} past the newest "
            f"θ_global; set rl.loop.max_staleness to {2 * n - 1} or more to let generation "
            "overlap a round."
        )

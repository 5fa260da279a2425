"""``phalanx run --launcher ray`` checks the cluster's resources against the roles'
first replicas before it starts anything (phalanx.launch.ray_job.shortage)."""

from __future__ import annotations

from phalanx.launch.ray_job import shortage


def test_enough_cpus_is_no_shortage() -> None:
    needs = {"policy": (2, 2), "rollout": (2, 1)}
    assert shortage(needs, {"CPU": 6.0}, 1.0, 0.0) is None
    assert shortage(needs, {"CPU": 3.0, "GPU": 6.0}, 0.5, 1.0) is None


def test_short_of_cpus_says_what_is_needed_and_what_there_is() -> None:
    line = shortage({"policy": (2, 2)}, {"CPU": 2.0}, 1.0, 0.0)
    assert line == (
        "the Ray cluster must have 4 CPU for 2 policy replicas of 2 ranks (at 1 CPU per "
        "rank): it has 2. Add nodes (ray start --address ...), or start fewer replicas "
        "(--replicas, roles.ROLE.n_init_replicas)."
    )


def test_every_role_is_counted_and_gpus_are_checked() -> None:
    needs = {"policy": (1, 2), "rollout": (1, 1)}
    line = shortage(needs, {"CPU": 8.0}, 1.0, 1.0)
    assert line is not None
    assert line.startswith(
        "the Ray cluster must have 3 GPU for 1 policy replica of 2 ranks, 1 rollout "
        "replica (at 1 GPU per rank): it has 0."
    )
    # A role with no replica to start is left out of the sentence.
    assert "rollout" not in (shortage({"policy": (2, 1), "rollout": (0, 1)}, {}, 1, 0) or "")

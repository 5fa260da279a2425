"""The module-scoped pytest fixture ``slurm``: a real Slurm cluster on this host
(:class:`phalanx.testing.slurm.SlurmCluster`), started once per test module and
stopped by its pids at the end. Where it cannot run (Slurm or munge missing, or not
root) the tests that use it skip with the reason.

    from slurm_cluster import slurm  # noqa: F401  (a module-scoped pytest fixture)

    def test_x(slurm):
        job = slurm.sbatch(script, "job.toml")
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from phalanx.testing.slurm import SlurmCluster, missing


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    why = missing()
    if why is not None:
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()

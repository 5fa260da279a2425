"""Fixtures for the integration tests: a real controller subprocess on port 0 with
a tmp state dir, and real replica subprocesses (see ``procs.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from procs import FAST_TIMEOUTS, Controller, Procs, Replica, write_job_toml


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    p = Procs(tmp_path)
    try:
        yield p
    finally:
        p.cleanup()


@pytest.fixture
def start_controller(tmp_path: Path, procs: Procs) -> Callable[..., Controller]:
    """``start_controller(n_init=.., join_timeout_s=.., max_body_bytes=.., controller={..},
    **timeouts)``
    writes a job TOML with fast timeouts (overridable), starts a controller on
    a fresh state dir and waits until it listens."""
    made = 0

    def start(
        n_init: int = 1,
        join_timeout_s: float = 0.5,
        max_body_bytes: int = 1 << 20,
        controller: dict[str, float | int] | None = None,
        **timeouts: float | bool,
    ) -> Controller:
        nonlocal made
        made += 1
        job = {
            "job": {"id": f"itest-{made}"},
            "timeouts": {**FAST_TIMEOUTS, **timeouts},
            "controller": {"max_body_bytes": max_body_bytes, "tick_s": 0.02, **(controller or {})},
            "roles.policy": {
                "min_replicas": 1,
                "n_init_replicas": n_init,
                "join_timeout_s": join_timeout_s,
            },
            # The tests' own failure detector registers here, outside the policy quorum.
            "roles.rollout": {"min_replicas": 1, "n_init_replicas": 1},
        }
        config = write_job_toml(tmp_path / f"job{made}.toml", job)
        return Controller(procs, tmp_path / f"state{made}", config).start()

    return start


@pytest.fixture
def start_replica(procs: Procs) -> Callable[..., Replica]:
    """``start_replica(controller, name, step_delay=0.05)`` starts a replica process."""

    def start(controller: Controller, name: str, step_delay: float = 0.05) -> Replica:
        return Replica(procs, controller, name, step_delay)

    return start

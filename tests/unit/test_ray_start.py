"""A local Ray instance that does not come up in Ray's fixed 30 s (a busy host) is
started again, and the third failure is one line that says what to do. Ray's own
start-up is stood in for by a stub of the two calls used (``init``/``shutdown``):
making a real raylet miss its deadline needs a host loaded past it."""

from __future__ import annotations

from typing import Any

import pytest

from phalanx.launch.ray_executor import LOCAL_START_TRIES, init_ray

TIMEOUT = (
    "The current node timed out during startup. This could happen because some of the "
    "raylet failed to startup or the GCS has become overloaded."
)


class SlowRay:
    def __init__(self, failures: int, message: str = TIMEOUT):
        self.failures, self.message = failures, message
        self.inits = self.shutdowns = 0

    def init(self, address: Any = None, **kw: Any) -> None:
        self.inits += 1
        if self.inits <= self.failures:
            raise Exception(self.message)

    def shutdown(self) -> None:
        self.shutdowns += 1


def test_a_local_start_that_times_out_is_tried_again():
    ray = SlowRay(failures=LOCAL_START_TRIES - 1)
    init_ray(ray, None, {"num_cpus": 2})
    assert ray.inits == LOCAL_START_TRIES and ray.shutdowns == LOCAL_START_TRIES - 1


def test_the_last_failure_says_what_to_do_in_one_line():
    ray = SlowRay(failures=LOCAL_START_TRIES)
    with pytest.raises(RuntimeError, match="did not start in 3 tries") as e:
        init_ray(ray, None, {})
    assert "\n" not in str(e.value) and "ray start --head" in str(e.value)


def test_other_failures_and_remote_clusters_are_not_retried():
    ray = SlowRay(failures=1, message="bad num_cpus")
    with pytest.raises(Exception, match="bad num_cpus"):
        init_ray(ray, None, {})
    remote = SlowRay(failures=1)
    with pytest.raises(Exception, match="timed out during startup"):
        init_ray(remote, "ray://head:10001", {})
    assert ray.inits == remote.inits == 1

"""The ``[rl.transport]`` config: its defaults and the URLs each field accepts."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from phalanx.config.rl import RLConfig, TransportSection


def test_transport_defaults_are_the_embedded_ones():
    t = RLConfig().transport
    assert (t.rollouts, t.weights, t.replay) == ("controller", "collective", None)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("rollouts", "kafka", "must be 'controller', a redis://host:port/db URL"),
        ("weights", "/tmp/w", "must be 'collective'"),
        ("rollouts", "redis:///0", "must name the Redis server"),
        ("replay", "file:///x", "must be 'memory' or a redis://"),
    ],
)
def test_transport_urls_are_checked(field: str, value: str, message: str):
    with pytest.raises(ValidationError, match=message):
        TransportSection(**{field: value})


def test_transport_urls_accepted():
    t = TransportSection(
        rollouts="redis://127.0.0.1:6379/0", weights="s3://bucket/w", replay="memory"
    )
    assert t.weights == "s3://bucket/w"
    assert TransportSection(rollouts="file:///tmp/rollouts").rollouts == "file:///tmp/rollouts"

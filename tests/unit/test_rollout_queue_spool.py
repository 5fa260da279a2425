"""The spool's record framing and the ``[rl.transport]`` config: pure logic."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from phalanx.config.rl import RLConfig, TransportSection
from phalanx.transport.spool import MAGIC, decode, encode


def test_records_round_trip_and_damage_is_isolated():
    recs = [{"rollout_id": f"p{i}.0", "x": [i] * i} for i in range(4)]
    blob = b"".join(encode(r) for r in recs)
    good, bad = decode(blob)
    assert [r for _, r in good] == recs and bad == []
    # Damage in record 1 loses record 1 only; a torn tail loses the tail only.
    offs = [o for o, _ in good]
    damaged = bytearray(blob)
    damaged[offs[1] + 14] ^= 0x55
    good, bad = decode(bytes(damaged[:-3]))
    assert [r["rollout_id"] for _, r in good] == ["p0.0", "p2.0"]
    assert bad == [(offs[1], offs[2]), (offs[3], len(blob) - 3)]
    # Garbage before the first marker is skipped up to it.
    good, bad = decode(b"junk" + blob)
    assert len(good) == 4 and bad == [(0, 4)]
    assert decode(MAGIC)[1] == [(0, 4)]


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
    assert TransportSection(rollouts="file:///tmp/spool").rollouts == "file:///tmp/spool"

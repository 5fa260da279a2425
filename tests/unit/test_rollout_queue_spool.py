"""The spool's record framing, its markers when the store's replies go astray (on
``memory://``), and the ``[rl.transport]`` config."""

from __future__ import annotations

import contextlib
import errno
import io
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from botocore.exceptions import ClientError
from pydantic import ValidationError
from s3fs.errors import translate_boto_error

from phalanx.config.rl import RLConfig, TransportSection
from phalanx.transport.base import TransportError
from phalanx.transport.spool import MAGIC, SpoolRolloutQueue, decode, encode


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


class LostReply:
    """A filesystem whose exclusive creates of paths containing ``part`` land, but
    whose reply is lost: the client retries, and the retry finds the object (what
    s3fs and botocore do after a read timeout or a dropped connection)."""

    def __init__(self, fs: Any, part: str):
        self.fs, self.part = fs, part

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fs, name)

    @contextlib.contextmanager
    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Iterator[Any]:
        if mode != "xb" or self.part not in path:
            with self.fs.open(path, mode, **kwargs) as f:
                yield f
            return
        buf = io.BytesIO()
        yield buf
        with self.fs.open(path, "xb") as f:
            f.write(buf.getvalue())  # the first request lands
        raise FileExistsError(path)  # ... and its retry finds what it wrote


def spool(consumer: str) -> SpoolRolloutQueue:
    return SpoolRolloutQueue(f"memory://spool-{uuid.uuid4().hex[:8]}", consumer, lease_s=60.0)


@pytest.mark.parametrize("part", ["/leases/", "/acks/"])
def test_a_create_whose_reply_was_lost_is_still_ours(part: str):
    q = spool("a")
    q.put([{"rollout_id": "p1.0"}])
    q.fs = LostReply(q.fs, part)
    ds = q.lease(1)
    assert [d.rollout_id for d in ds] == ["p1.0"], "the lease this consumer took is its own"
    assert q.ack(ds) == 1, "the ack this consumer made counts"
    assert q.ack(ds) == 0  # a second ack of it counts nothing
    assert q.counts()["acked"] == 1


class Conflicts:
    """A filesystem whose exclusive creates first fail ``n`` times with ``error``."""

    def __init__(self, fs: Any, error: OSError, n: int):
        self.fs, self.error, self.n = fs, error, n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.fs, name)

    def open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if mode == "xb" and self.n > 0:
            self.n -= 1
            raise self.error
        return self.fs.open(path, mode, **kwargs)


def test_a_conflicting_conditional_write_is_retried():
    # S3 answers 409 ConditionalRequestConflict to a conditional write racing another
    # operation on the key: asking again settles it. Any other error is the backend's.
    q = spool("a")
    q.put([{"rollout_id": "p1.0"}])
    reply = {
        "Error": {"Code": "ConditionalRequestConflict", "Message": "a conflicting operation"},
        "ResponseMetadata": {"HTTPStatusCode": 409},
    }
    conflict = translate_boto_error(ClientError(reply, "PutObject"))  # as s3fs raises it
    q.fs = Conflicts(q.fs, conflict, 2)
    ds = q.lease(1)
    assert [d.rollout_id for d in ds] == ["p1.0"]
    q.fs = Conflicts(q.fs.fs, OSError(errno.EACCES, "Access Denied"), 1)
    with pytest.raises(TransportError, match="cannot create"):
        q.ack(ds)

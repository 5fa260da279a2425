"""Liveness pings (phalanx.comm.liveness): a process answers for the groups it holds."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator

import pytest

from phalanx.comm import liveness

WAIT_S = 30.0


def until(pred: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@pytest.fixture()
def responder() -> Iterator[liveness.Responder]:
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    r = liveness.respond(port)
    assert r is not None
    yield r
    r.close()


def test_a_peer_counts_as_there_only_while_it_holds_the_group(
    responder: liveness.Responder,
) -> None:
    group = f"127.0.0.1:1/test/q{responder.port}"
    w = liveness.Watch()
    w.set(group, {"p": f"127.0.0.1:{responder.port}"})
    assert w.silent() == ["p"]  # nothing heard yet
    w.begin()
    try:
        # It answers, but not as a member: not there for this group.
        time.sleep(3 * liveness.INTERVAL_S)
        assert w.silent() == ["p"]
        liveness.join(group)
        until(lambda: w.silent() == [], "the member's answer")
        liveness.join(group)  # held twice (two communicators): one leave keeps it
        liveness.leave(group)
        time.sleep(3 * liveness.INTERVAL_S)
        assert w.silent() == []
        liveness.leave(group)
        until(lambda: w.silent() == ["p"], "the answer that it left")
    finally:
        w.end()


def test_a_silent_or_unknown_peer_is_named(responder: liveness.Responder) -> None:
    group = "127.0.0.1:2/test/q"
    liveness.join(group)
    try:
        w = liveness.Watch()
        closed = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        closed.bind(("127.0.0.1", 0))  # bound, never answers
        w.set(
            group,
            {
                "up": f"127.0.0.1:{responder.port}",
                "mute": f"127.0.0.1:{closed.getsockname()[1]}",
                "nowhere": "no-such-host.invalid:1",
            },
        )
        w.begin()
        until(lambda: w.silent() == ["mute", "nowhere"], "the answering peer")
        w.end()
        # Answers older than ALIVE_S no longer count.
        until(lambda: w.silent() == ["up", "mute", "nowhere"], "the answer to age")
        closed.close()
    finally:
        liveness.leave(group)


def test_no_peers_watched_means_nothing_is_known() -> None:
    assert liveness.Watch().silent() == ["(no peers watched)"]


def test_garbage_datagrams_get_no_answer(responder: liveness.Responder) -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.settimeout(0.3)
    for junk in (b"", b"PXL1", b"x" * 28, b"PXL1" + b"\0" * 40):
        s.sendto(junk, ("127.0.0.1", responder.port))
    with pytest.raises(TimeoutError):
        s.recv(64)
    s.close()


def test_a_peer_at_an_older_quorum_round_is_not_in_the_collective(
    responder: liveness.Responder,
) -> None:
    """A member that has not taken this step's quorum round is not in its
    collectives, and may never be: cut off from the controller after its request
    made the quorum form, it holds the group and answers as a member, but waits
    for an answer that cannot reach it (bench/partitions.py's
    replica_from_controller once stalled 30 s, the whole patience, on that)."""
    group = f"127.0.0.1:3/test/q{responder.port}"
    liveness.join(group)
    try:
        liveness.enter(group, 6)
        w = liveness.Watch()
        w.set(group, {"p": f"127.0.0.1:{responder.port}"})
        w.at(7)  # this process took round 7; the peer answers from round 6
        w.begin()
        try:
            time.sleep(3 * liveness.INTERVAL_S)
            assert w.silent() == ["p"]
            liveness.enter(group, 7)  # told of round 7: in the step
            until(lambda: w.silent() == [], "the answer from round 7")
            liveness.enter(group, 8)  # ahead (it finished the step): still there
            time.sleep(3 * liveness.INTERVAL_S)
            assert w.silent() == []
            liveness.enter(group, 5)  # rounds never go back
            time.sleep(3 * liveness.INTERVAL_S)
            assert w.silent() == []
        finally:
            w.end()
    finally:
        liveness.leave(group)
    liveness.join(group)  # a group held again starts from no round
    try:
        assert liveness.member(liveness.digest(group)) == (True, 0)
    finally:
        liveness.leave(group)

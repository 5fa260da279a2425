"""Patient collectives over real processes: a collective past the collective
timeout is waited for while its peer answers liveness pings as a member, and given
up, before the patience, when the peer is stopped (SIGSTOP) or has left the group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from procs import PROGRESS_S, child_env, wait_for

WORKER = Path(__file__).with_name("liveness_worker.py")
TIMEOUT_S, PATIENCE_S = 0.5, 20.0  # as in liveness_worker.py


class Pair:
    def __init__(self, mode0: str, mode1: str, timeout_s: float = TIMEOUT_S):
        self.procs = [
            subprocess.Popen(
                [sys.executable, str(WORKER), str(rank), mode, str(timeout_s)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                env=child_env(),
                start_new_session=True,
            )
            for rank, mode in enumerate((mode0, mode1))
        ]
        addresses = [self.line(r)["address"] for r in (0, 1)]
        for rank in (0, 1):
            self.write(rank, addresses[1 - rank])

    def write(self, rank: int, text: str) -> None:
        inp = self.procs[rank].stdin
        assert inp is not None
        inp.write((text + "\n").encode())
        inp.flush()

    def line(self, rank: int) -> dict[str, Any]:
        out = self.procs[rank].stdout
        assert out is not None
        text = out.readline()
        assert text, f"rank {rank} exited with {self.procs[rank].wait()}"
        return dict(json.loads(text))

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=PROGRESS_S)


@pytest.fixture()
def pairs() -> Iterator[list[Pair]]:
    made: list[Pair] = []
    yield made
    for p in made:
        p.close()


def test_a_collective_slowed_by_a_live_peer_is_waited_for(pairs: list[Pair]) -> None:
    pair = Pair("reduce", "late")
    pairs.append(pair)
    r0, r1 = pair.line(0), pair.line(1)
    assert r0["ok"] and r1["ok"], (r0, r1)
    assert r0["sum"] == [3.0] * 4 == r1["sum"]
    assert r0["votes"] == 2.0 == r1["votes"]
    # Rank 1 came 2 s late: past the 0.5 s timeout, and rank 0 still got its sum.
    assert r0["elapsed_s"] > TIMEOUT_S


def test_a_receive_posted_late_by_a_live_peer_is_waited_for(pairs: list[Pair]) -> None:
    # A heal's transfer: gloo's own wait on a send fails the whole group at its
    # timeout, so a patient send must be given the patience from the start.
    pair = Pair("send", "late-recv")
    pairs.append(pair)
    r0, r1 = pair.line(0), pair.line(1)
    assert r0["ok"] and r1["ok"], (r0, r1)
    assert r1["got"] == [0.0, 1.0, 2.0, 3.0]
    assert r0["elapsed_s"] > TIMEOUT_S


def test_a_stopped_peer_is_given_up_and_its_late_op_does_not_count(pairs: list[Pair]) -> None:
    pair = Pair("reduce", "hold")
    pairs.append(pair)
    assert pair.line(1) == {"holding": True}
    os.killpg(pair.procs[1].pid, signal.SIGSTOP)
    r0 = pair.line(0)
    assert not r0["ok"]
    assert "peer(s) peer silent or gone from the group" in r0["error"], r0
    assert r0["elapsed_s"] < PATIENCE_S
    # Rank 0 gave the all-reduce up, but gloo still runs its side until the patience:
    # resumed, rank 1's all-reduce completes against it. Rank 1 must not count it as
    # agreed: rank 0 left the group, so rank 1's vote (an op of its own) fails.
    os.killpg(pair.procs[1].pid, signal.SIGCONT)
    pair.write(1, "go")
    r1 = pair.line(1)
    assert not r1["ok"], r1
    assert r1["votes"] is None
    assert "peer(s) peer silent or gone from the group" in r1["error"], r1


def test_a_waiter_that_was_stopped_gives_its_peer_a_collective_timeout(
    pairs: list[Pair],
) -> None:
    # Both ranks stopped (a paused VM, or a test holding a job): the waiter resumes
    # first and its peer 1.5 s later, past ALIVE_S (0.5 s) but within the 5 s
    # collective timeout. What the waiter did not hear while stopped says nothing of
    # its peer, which gets a whole collective timeout from the waiter's resumption.
    timeout_s = 5.0
    pair = Pair("announce", "hold", timeout_s)
    pairs.append(pair)
    assert pair.line(1) == {"holding": True}
    assert pair.line(0) == {"reducing": True}
    time.sleep(1.0)  # for rank 0 to be waiting on its op (if not, the test proves less)
    for p in pair.procs:
        os.killpg(p.pid, signal.SIGSTOP)
    time.sleep(timeout_s)  # rank 0's first wait, of the collective timeout, ends stopped
    os.killpg(pair.procs[0].pid, signal.SIGCONT)
    time.sleep(1.5)
    os.killpg(pair.procs[1].pid, signal.SIGCONT)
    pair.write(1, "go")
    r0, r1 = pair.line(0), pair.line(1)
    assert r0["ok"] and r1["ok"], (r0, r1)
    assert r0["sum"] == [3.0] * 4 == r1["sum"]
    # Rank 0 waited through its stop and its peer's late resumption (had it been
    # stopped before its op began, this would be the 1.5 s alone).
    assert r0["elapsed_s"] > 1.0


def test_a_peer_that_left_the_group_is_given_up_before_the_patience(pairs: list[Pair]) -> None:
    pair = Pair("reduce", "leave")
    pairs.append(pair)
    assert pair.line(1) == {"left": True}
    r0 = pair.line(0)
    assert not r0["ok"]
    # It dropped the group with no op given up, so at once: its connections close
    # (gloo's error says how the socket ended), or, were they still open, it would
    # answer the pings as no longer a member.
    assert r0["error"].startswith("allreduce"), r0
    assert r0["elapsed_s"] < PATIENCE_S
    wait_for(lambda: pair.procs[1].poll() is None, PROGRESS_S, "the peer to stay alive")

"""``transport/streamed.py`` and the collective channel's stream over real gloo groups:
a bucketed broadcast received tensor by tensor, equal to what was sent; a sender
SIGKILLed mid-stream, which the receiver learns as one line, not a hang; the
channel's ``fetch_stream`` feeding an engine (the HF engine takes a stream too)."""

from __future__ import annotations

import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from pathlib import Path

import pytest
import torch
from procs import Procs, signal_group, wait_for
from stream_sender import weights
from transformers import GPT2Config, GPT2LMHeadModel

from phalanx.comm.base import CommError
from phalanx.comm.torch_pg import TorchCommunicator, serve_store
from phalanx.rl.engine.hf import HFEngine
from phalanx.transport.base import SyncOrder
from phalanx.transport.collective import CollectiveWeightChannel
from phalanx.transport.streamed import receive_stream

SENDER = str(Path(__file__).with_name("stream_sender.py"))
BUCKET = 4096  # bytes: every tensor but the last spans buckets, and most share one


def receiver(addr: str) -> tuple[TorchCommunicator, torch.Tensor, dict[str, torch.Tensor]]:
    comm = TorchCommunicator(30.0)
    comm.configure(addr, "stream", 1, 2)
    like = {k: torch.empty_like(t) for k, t in weights().items()}
    flat = torch.empty(sum(t.numel() * t.element_size() for t in like.values()), dtype=torch.uint8)
    return comm, flat, like


def test_buckets_arrive_as_a_stream_of_equal_tensors(procs: Procs):
    _store, addr = serve_store()
    sender, _, err = procs.spawn([sys.executable, SENDER, addr, str(BUCKET)], "sender")
    comm, flat, like = receiver(addr)
    try:
        got = list(receive_stream(comm, flat, like, BUCKET))
    finally:
        comm.abort()
    assert sender.wait(60) == 0, err.read_text()
    want = weights()
    assert [k for k, _ in got] == sorted(want)  # in the wire's order
    assert all(torch.equal(t, want[k]) and t.dtype == want[k].dtype for k, t in got)


def test_a_sender_killed_mid_stream_ends_the_stream_in_one_line(procs: Procs):
    _store, addr = serve_store()
    # 5 buckets: all of a.weight (16 KiB, the first tensor) and part of b.bias.
    sender, out, _ = procs.spawn(
        [sys.executable, SENDER, addr, str(BUCKET), "5"], "sender", stdin=subprocess.PIPE
    )
    comm, flat, like = receiver(addr)
    stream = receive_stream(comm, flat, like, BUCKET)
    try:
        name, first = next(stream)
        assert name == "a.weight" and torch.equal(first, weights()["a.weight"])
        wait_for(lambda: "stalled" in out.read_text(), 60, "the sender to stall")
        signal_group(sender, signal.SIGKILL)
        with pytest.raises(CommError) as e:
            next(stream)
    finally:
        comm.abort()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("the weight stream broke after 1 of 4 tensors")


def order(rank: int, addr: str) -> SyncOrder:
    return SyncOrder(seq=1, mesh_id=1, members=("p:1", "r:1"), rank=rank, store=addr)


def test_the_channel_streams_a_version_into_an_hf_engine():
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    torch.manual_seed(0)
    policy, rollout = GPT2LMHeadModel(cfg), GPT2LMHeadModel(cfg)
    engine = HFEngine(rollout, eos_id=0, pad_id=0, version=0)
    leader, rx = CollectiveWeightChannel(30.0, bucket=1000), CollectiveWeightChannel(30.0)
    _store, addr = serve_store()
    try:
        with ThreadPoolExecutor(1) as pool:
            got = pool.submit(rx.fetch_stream, order(1, addr), engine.layout())
            leader.publish(3, policy.state_dict(), order(0, addr), lambda res: None)
            version, stream = got.result(60)
            assert version == 3 and rx.kept is None  # known before any tensor moved
            with closing(stream):
                engine.load_weights(stream, version)
        assert leader.pending is not None and leader.pending.result(60).ok
    finally:
        leader.close()
        rx.close()
    own = rollout.state_dict()
    assert engine.version == 3
    assert all(torch.equal(own[k], t) for k, t in policy.state_dict().items())
    assert rx.kept is not None and rx.kept[0] == 3  # kept whole, to relay

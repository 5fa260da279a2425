"""The synchronous DiLoCo exchange over real gloo process groups (three ranks
in threads of this process, one TCPStore): every rank gets the same bits, the
uncompressed average is the plain mean, and compressed exchanges equal the
decode-and-sum-in-rank-order that the object store computes."""

from __future__ import annotations

import threading

import pytest
import torch
from rank_threads import run_ranks

from phalanx.comm.compress import decode, encode, wire_bytes
from phalanx.comm.torch_pg import TorchCommunicator
from phalanx.train.diloco_sync import CollectiveReducer

_INIT = threading.Lock()

K = 3


def tensors(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(7, 5, generator=g), torch.randn(11, generator=g)]


def run(compression: str) -> tuple[list[list[torch.Tensor]], list[CollectiveReducer]]:
    comms = [TorchCommunicator(10.0) for _ in range(K)]
    reducers = [CollectiveReducer(c, compression) for c in comms]  # type: ignore[arg-type]
    out: list[list[torch.Tensor]] = [[] for _ in range(K)]

    def body(rank: int) -> None:
        out[rank], n = reducers[rank].average(tensors(rank), round=0, fragment=0)
        assert n == K

    run_ranks(comms, "diloco-test", body)
    return out, reducers


@pytest.mark.parametrize("compression", ["none", "fp16", "bf16", "int8"])
def test_every_rank_gets_the_same_average(compression: str):
    out, reducers = run(compression)
    for rank_out in out[1:]:
        for a, b in zip(out[0], rank_out, strict=True):
            assert torch.equal(a, b)
    if compression == "none":
        want = [sum(tensors(r)[i] for r in range(K)) / K for i in range(2)]
        for a, w in zip(out[0], want, strict=True):
            torch.testing.assert_close(a, w, rtol=0, atol=1e-6)
        assert reducers[0].bytes_sent == (35 + 11) * 4
    else:
        # The object store's rule: decode each rank's wire form, sum in rank order in fp32.
        for i, got in enumerate(out[0]):
            acc = torch.zeros_like(got)
            for r in range(K):
                t = tensors(r)[i]
                acc += decode(encode(t, compression), compression, t)
            assert torch.equal(got, acc / K)
        sent = sum(wire_bytes(encode(t, compression)) for t in tensors(0))
        assert reducers[0].bytes_sent == sent < (35 + 11) * 4


def test_an_exact_exchange_does_not_depend_on_the_members_order():
    """``train.exact_reduction``: each replica's pseudo-gradient is a term of an exact
    sum, so the ranks' order in the group (it follows membership) does not matter."""
    comms = [TorchCommunicator(10.0) for _ in range(K)]
    reducers = [CollectiveReducer(c, exact=True) for c in comms]  # type: ignore[arg-type]
    out: list[list[torch.Tensor]] = [[] for _ in range(K)]
    order = [2, 0, 1]  # rank r holds replica order[r]'s pseudo-gradient

    def body(rank: int) -> None:
        out[rank], n = reducers[rank].average(tensors(order[rank]), round=0, fragment=0)
        assert n == K

    run_ranks(comms, "diloco-exact", body)
    plain, _ = run("none")
    want = [sum(tensors(r)[i].double() for r in range(K)).float() / K for i in range(2)]
    for rank_out in out:
        for a, w, p in zip(rank_out, want, plain[0], strict=True):
            assert torch.equal(a, w)  # the exact sum, rounded once, over K
            torch.testing.assert_close(a, p, rtol=0, atol=1e-6)
    assert reducers[0].bytes_sent == (35 + 11) * 8 + 3 * 8 + 3 * 8  # sums, exponents, meta


def test_an_exact_exchange_refuses_a_compressed_wire():
    with pytest.raises(ValueError, match="exact DiLoCo exchange must be uncompressed"):
        CollectiveReducer(TorchCommunicator(1.0), "int8", exact=True)


def _streaming(overlap: bool) -> tuple[list[list[torch.Tensor]], list[CollectiveReducer]]:
    """Three ranks run Streaming DiLoCo (H = 4, 2 fragments, τ = 1) on a tiny model for
    3 rounds, each rank on its own data; with ``overlap`` the exchanges run behind the
    next inner step (the reducer's ``start``), without it they block (``average``)."""
    from phalanx.train.diloco import DiLoCo, DiLoCoConfig

    cfg = DiLoCoConfig(H=4, fragments=2, tau=1, outer_lr=0.7, outer_momentum=0.9)
    comms = [TorchCommunicator(10.0) for _ in range(K)]
    reducers = [CollectiveReducer(c) for c in comms]  # type: ignore[arg-type]
    out: list[list[torch.Tensor]] = [[] for _ in range(K)]
    inflight = [0] * K

    class Blocking:  # the same reducer without ``start``: every exchange blocks
        def __init__(self, r: CollectiveReducer):
            self.r = r

        def average(self, t: list[torch.Tensor], *, round: int, fragment: int):
            return self.r.average(t, round=round, fragment=fragment)

    def body(rank: int) -> None:
        # The ranks are threads of one process, sharing torch's global generator:
        # one rank at a time seeds it and draws the same initial weights.
        with _INIT:
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        red = reducers[rank] if overlap else Blocking(reducers[rank])
        dl = DiLoCo(model, cfg, red)  # type: ignore[arg-type]
        g = torch.Generator().manual_seed(10 + rank)
        for _ in range(3 * cfg.H):
            opt.zero_grad()
            model(torch.randn(8, 5, generator=g)).pow(2).mean().backward()
            opt.step()
            dl.after_inner_step()
            # An exchange still running while the next inner step trains.
            inflight[rank] += any(not isinstance(v, list) for _, v in dl.pending.values())
        dl.settle()
        dl.finish()
        out[rank] = [p.detach().clone() for p in model.parameters()]

    run_ranks(comms, f"diloco-stream-{overlap}", body)
    assert all(inflight) if overlap else not any(inflight)
    return out, reducers


def test_streaming_exchanges_overlap_the_next_inner_steps_and_give_the_same_bits():
    """τ = 1: each fragment's all-reduce is started, the next inner step runs, and its
    result is applied then, as when the exchange blocked: the same bits on every rank,
    and the same as the blocking run's."""
    started, _ = _streaming(overlap=True)
    blocking, _ = _streaming(overlap=False)
    for rank_out in [*started[1:], *blocking]:
        for a, b in zip(started[0], rank_out, strict=True):
            assert torch.equal(a, b)

"""The FT manager with an exact reduction (``exact_reduction=True``): its share is a
run of fixed units of the global batch, each unit computed once per step whatever
the quorum does to the share, and the summed gradient (and loss) are the same bits
whoever took part, over real gloo groups of threads. The controller client is never
contacted."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from rank_threads import run_ranks

from phalanx.client import ControllerClient
from phalanx.comm.torch_pg import TorchCommunicator
from phalanx.data.sampler import ElasticSampler
from phalanx.jobs.mlp import make_compute
from phalanx.train.manager import Manager

BATCH, MICRO, DATA = 20, 3, 64
"""7 units: six of 3 samples and a last one of 2."""

pytestmark = pytest.mark.usefixtures("one_thread")


def make(comm: TorchCommunicator | None = None) -> tuple[Manager, list[list[int]], object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(DATA, 4, generator=g), torch.randn(DATA, 2, generator=g)
    calls: list[list[int]] = []
    inner = make_compute(model, x, y)

    def fn(indices: list[int], scale: float) -> float:
        calls.append(list(indices))
        return inner(indices, scale)

    client = ControllerClient("http://127.0.0.1:9", "policy", "t", token="unused")
    m = Manager(
        client,
        comm or TorchCommunicator(30.0),
        model,
        torch.optim.AdamW(model.parameters(), lr=0.01),
        ElasticSampler(DATA, seed=3),
        global_batch_size=BATCH,
        micro_batch_size=MICRO,
        exact_reduction=True,
    )
    m._incarnation = client.incarnations  # as wait_quorum records it
    return m, calls, fn


@pytest.fixture
def one() -> Iterator[tuple[Manager, list[list[int]], object]]:
    m, calls, fn = make()
    try:
        yield m, calls, fn
    finally:
        m.close()


def test_a_share_is_whole_units_and_a_changed_share_computes_only_its_new_units(one) -> None:
    m, calls, fn = one
    stream = m.sampler.positions(0, BATCH)
    m.compute(fn, 0, 2)  # the guess: units 0..3 of 7
    assert calls == [stream[0:3], stream[3:6], stream[6:9], stream[9:12]]
    assert sorted(m.grads.units.held) == [0, 1, 2, 3]
    calls.clear()
    m.compute(fn, 1, 3)  # the quorum: units 3..4 (split of 7 over 3: 3, 2, 2)
    assert calls == [stream[12:15]]
    assert sorted(m.grads.units.held) == [3, 4]
    assert m.last_indices == stream[9:15]
    calls.clear()
    m.compute(fn, 2, 3)  # units 5..6: the last one short
    assert calls == [stream[15:18], stream[18:20]]
    calls.clear()
    m.compute(fn, 2, 3)
    assert calls == []
    m.step += 1  # a committed step: the old model's units are freed
    m.compute(fn, 2, 3)
    assert len(calls) == 2


def test_every_membership_and_every_guess_sums_to_the_same_bits() -> None:
    results: dict[int, list[tuple[list[torch.Tensor], float]]] = {}
    for k in (1, 2, 3, 4):
        comms = [TorchCommunicator(30.0) for _ in range(k)]
        made = [make(c) for c in comms]
        out: list[tuple[list[torch.Tensor], float]] = [([], 0.0)] * k

        def body(r: int, made=made, out=out, k=k) -> None:
            m, _, fn = made[r]
            m.rank, m.world_size = r, k
            m.compute(fn, (r + 1) % 2, 2)  # a wrong guess first: some units kept, some not
            m.compute(fn, r, k)
            loss = m.allreduce_grads()
            assert m.grads.vote_ok and m.ok
            out[r] = ([p.grad.clone() for p in m.model.parameters()], loss)

        try:
            run_ranks(comms, f"exact-manager-{k}", body)
        finally:
            for m, _, _ in made:
                m.close()
        results[k] = out
    want, loss = results[1][0]
    for k, outs in results.items():
        for grads, got_loss in outs:
            assert got_loss == loss, k
            for a, b in zip(grads, want, strict=True):
                assert torch.equal(a, b), k


def test_a_failed_exchange_keeps_the_units_for_the_retry(one, monkeypatch) -> None:
    m, calls, fn = one
    monkeypatch.setattr(m.client, "report_failure", lambda *a, **kw: None)  # no controller
    m.compute(fn, 0, 1)
    held = {j: s.buckets[0].clone() for j, s in m.grads.units.held.items()}
    m.allreduce_grads()  # no group configured: the exchange fails, the replica votes no
    assert not m.ok and not m.grads.vote_ok
    calls.clear()
    m.compute(fn, 0, 1)
    assert calls == []
    for j, s in m.grads.units.held.items():
        assert torch.equal(s.buckets[0], held[j])

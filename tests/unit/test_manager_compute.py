"""A step's gradients are computed once per sample, whatever the quorum does to
the replica's share: the speculative guess, a changed share and a retry after a
failed exchange compute only the samples the gradients do not already hold
(:meth:`phalanx.train.manager.Manager.compute`). The manager here is the real
one; its controller client is never contacted (compute does not talk to it).
The last test is the commit vote's rule about the replica's incarnation."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from phalanx.client import ControllerClient
from phalanx.comm.torch_pg import TorchCommunicator, serve_store
from phalanx.data.sampler import ElasticSampler
from phalanx.jobs.mlp import make_compute
from phalanx.net import LOOPBACK
from phalanx.train.manager import Manager

BATCH, DATA = 16, 64


@pytest.fixture
def setup() -> Iterator[tuple[Manager, list[list[int]], object]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = model.double()
    x, y = torch.randn(DATA, 4, dtype=torch.float64), torch.randn(DATA, 2, dtype=torch.float64)
    calls: list[list[int]] = []
    inner = make_compute(model, x, y)

    def fn(indices: list[int], scale: float) -> float:
        calls.append(list(indices))
        return inner(indices, scale)

    client = ControllerClient("http://127.0.0.1:9", "policy", "t", token="unused")
    m = Manager(
        client,
        TorchCommunicator(1.0),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        ElasticSampler(DATA, seed=3),
        global_batch_size=BATCH,
        micro_batch_size=4,
    )
    try:
        yield m, calls, fn
    finally:
        m.close()


def grads(m: Manager) -> list[torch.Tensor]:
    return [p.grad.clone() for p in m.model.parameters() if p.grad is not None]


def test_a_grown_share_computes_only_the_new_samples(setup) -> None:
    m, calls, fn = setup
    half = m.compute(fn, 0, 2)  # the guess: rank 0 of 2
    first = sorted(i for c in calls for i in c)
    calls.clear()
    whole = m.compute(fn, 0, 1)  # the quorum: alone now
    added = sorted(i for c in calls for i in c)
    assert len(first) == BATCH // 2 and len(added) == BATCH // 2
    assert not set(first) & set(added)
    assert sorted(first + added) == sorted(m.last_indices)
    held = grads(m)
    # The same as computing the whole share at once.
    m.grads.zero()
    m.accumulator.forget()
    calls.clear()
    again = m.compute(fn, 0, 1)
    assert len([i for c in calls for i in c]) == BATCH
    assert whole == pytest.approx(again, rel=1e-12) and half < whole
    for a, b in zip(held, grads(m), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_the_same_share_again_computes_nothing(setup) -> None:
    m, calls, fn = setup
    loss = m.compute(fn, 1, 2)
    calls.clear()
    assert m.compute(fn, 1, 2) == loss and calls == []


def test_another_share_or_summed_gradients_start_over(setup) -> None:
    m, calls, fn = setup
    m.compute(fn, 0, 2)
    calls.clear()
    m.compute(fn, 1, 2)  # not a superset of what is held: zeroed, all computed
    assert len([i for c in calls for i in c]) == BATCH // 2
    calls.clear()
    m.grads.local = False  # what an all-reduce leaves (in place, even a failed one)
    m.compute(fn, 1, 2)
    assert len([i for c in calls for i in c]) == BATCH // 2
    calls.clear()
    m.step += 1  # a committed step: the held gradients are the old model's
    m.compute(fn, 1, 2)
    assert len([i for c in calls for i in c]) == BATCH // 2


def test_an_incarnation_evicted_during_the_step_votes_no_in_the_all_reduce(setup) -> None:
    """The client registers a new incarnation (from its heartbeat thread) when it
    learns it was evicted. A step taken by the previous one votes no in the step's
    all-reduce, so that its whole group retries (its peers may already be going on
    from the same step without it). Learned after the vote, the eviction does not
    stop the commit: every member voted yes and commits alike."""
    m = setup[0]
    store, address = serve_store(LOOPBACK)
    m.comm.configure(address, "policy/q1", 0, 1)  # a real gloo group of one
    m.client.replica_id, m.client.incarnations = "policy-0:a", 1
    assert m._identity() == ("policy-0:a", 1)
    m._incarnation = 1  # as wait_quorum records it
    m.grads.zero()
    m.allreduce_grads()
    assert m.grads.vote_ok and m.should_commit() and m.step == 1
    m._ok, m._abstained = True, None  # a new step (as wait_quorum resets them)
    m.client.replica_id, m.client.incarnations = "policy-0:b", 2  # register()
    m.allreduce_grads()
    assert not m.grads.vote_ok and not m.should_commit()
    assert m.step == 1 and m.sampler.cursor == BATCH
    assert m.ok, "a no vote of its own blames no peer: the group is kept"
    assert m.error == "evicted during the step: its peers may go on without it"
    # Evicted after a yes vote: it commits with its group.
    m._ok, m._abstained, m._incarnation = True, None, 2
    m.allreduce_grads()
    m.client.incarnations = 3
    assert m.should_commit() and m.step == 2 and m.sampler.cursor == 2 * BATCH
    del store

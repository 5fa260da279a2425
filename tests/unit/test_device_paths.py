"""The data plane's collectives on each device: every tensor a collective is
handed lives on its communicator's device (NCCL takes only tensors on its GPU,
gloo only CPU ones). The same bodies run on CPU over gloo in the default run,
and over NCCL on GPUs under the ``gpu`` mark (on the device machine):

- the FT step's exchange: the gradient buckets and the vote-and-loss side
  tensor (:class:`~phalanx.train.grads.GradBuffer`), in one all-reduce; and the
  exact one (:class:`~phalanx.train.exact.ExactSum`), which gives the CPU's bits;
- a heal: a state tree sent and received (:mod:`phalanx.comm.transfer`);
- a weight sync by broadcast (:class:`~phalanx.transport.collective.
  CollectiveWeightChannel`), and its relay by the replica that fetched it.

NCCL refuses two ranks on one GPU: the two-rank cases need two GPUs and skip,
saying so, where there is one; the FT step's exchange runs with one rank per
GPU there is (an NCCL group of one still takes only tensors on its device)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from groups import Hub
from rank_threads import run_ranks, run_threads

from phalanx.comm.torch_pg import TorchCommunicator
from phalanx.comm.transfer import recv_state, send_state
from phalanx.train.exact import ExactSum, Term
from phalanx.train.grads import GradBuffer
from phalanx.transport.base import SyncOrder, SyncResult
from phalanx.transport.collective import CollectiveWeightChannel

DEVICES = [
    pytest.param("cpu", id="gloo"),
    pytest.param("cuda", id="nccl", marks=pytest.mark.gpu),
]


def rank_devices(kind: str, want: int, least: int) -> list[torch.device]:
    """``want`` ranks' devices: CPUs, or one GPU each (as many as there are, at
    least ``least``, else the test is skipped with the reason)."""
    if kind == "cpu":
        return [torch.device("cpu")] * want
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have < least:
        need = (
            "a CUDA device"
            if least == 1
            else f"{least} CUDA devices (NCCL refuses two ranks on one GPU)"
        )
        pytest.skip(f"needs {need}: this machine has {have}")
    return [torch.device("cuda", r) for r in range(min(want, have))]


@pytest.mark.parametrize("kind", DEVICES)
def test_an_ft_steps_gradients_and_vote_are_summed_on_the_device(kind: str) -> None:
    devs = rank_devices(kind, 2, 1)
    n = len(devs)
    comms = [TorchCommunicator(60.0, d) for d in devs]
    out: dict[int, dict[str, Any]] = {}

    def body(rank: int) -> None:
        dev = devs[rank]
        torch.manual_seed(0)  # the same initial model on every rank
        model = torch.nn.Linear(8, 4).double().to(dev)
        grads = GradBuffer(model, bucket_bytes=128)  # several buckets, then the side tensor
        torch.manual_seed(1 + rank)  # each rank's own batch
        model(torch.randn(16, 8, dtype=torch.float64, device=dev)).pow(2).sum().backward()
        mine = [p.grad.detach().cpu().clone() for p in model.parameters()]
        loss = grads.allreduce(comms[rank], n, float(rank + 1), vote=True)
        summed = [p.grad.detach().cpu().clone() for p in model.parameters()]
        yes = grads.vote_ok
        grads.allreduce(comms[rank], n, 0.0, vote=rank != n - 1)  # the last rank votes no
        out[rank] = {
            "mine": mine,
            "summed": summed,
            "loss": loss,
            "yes": yes,
            "no": grads.vote_ok,
            "on": {grads.meta.device, *(b.device for b in grads.buckets)},
        }

    run_ranks(comms, f"step-{kind}", body)
    total = [sum(out[r]["mine"][i] for r in range(n)) for i in range(2)]
    for r in range(n):
        o = out[r]
        assert o["on"] == {devs[r]}
        assert o["loss"] == pytest.approx(n * (n + 1) / 2)
        assert o["yes"] is True and o["no"] is False
        for want, got in zip(total, o["summed"], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kind", DEVICES)
def test_an_exact_sum_runs_on_the_device_and_gives_the_bits_of_the_cpu(kind: str) -> None:
    devs = rank_devices(kind, 2, 1)
    n = len(devs)
    comms = [TorchCommunicator(60.0, d) for d in devs]
    g = torch.Generator().manual_seed(0)
    terms = [
        Term([torch.randn(1000, generator=g) * 10.0 ** (i - 2) for _ in range(2)], 0.1 * i)
        for i in range(5)
    ]
    out: dict[int, Any] = {}

    def body(rank: int) -> None:
        dev = devs[rank]
        mine = [Term([t.to(dev) for t in term.tensors], term.loss) for term in terms[rank::n]]
        res = [torch.empty(1000, device=dev) for _ in range(2)]
        o = ExactSum().allreduce(comms[rank], mine, res)
        out[rank] = ([r.cpu() for r in res], o, {r.device for r in res})

    run_ranks(comms, f"exact-{kind}", body)
    want = [torch.empty(1000) for _ in range(2)]
    alone = ExactSum().allreduce(Hub(1).comms()[0], terms, want)
    for r in range(n):
        got, o, on = out[r]
        assert on == {devs[r]} and o.loss == alone.loss and o.votes == n
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


def moved(tree: Any, dev: torch.device) -> Any:
    """``tree`` with every tensor on ``dev``."""
    if isinstance(tree, torch.Tensor):
        return tree.to(dev)
    if isinstance(tree, dict):
        return {k: moved(v, dev) for k, v in tree.items()}
    return tree


@pytest.mark.parametrize("kind", DEVICES)
def test_a_heals_state_arrives_on_the_receivers_device(kind: str) -> None:
    devs = rank_devices(kind, 2, 2)
    comms = [TorchCommunicator(60.0, d) for d in devs]
    big = torch.arange(300_000, dtype=torch.float32)  # over DIRECT_BYTES: sent from its storage
    state = {
        "model": {"w": big, "b": torch.tensor([1.5, -2.0], dtype=torch.float64)},
        "optimizer": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": big * 2}}},
        "step": 7,
        "rng": [1, 2, 3],
    }
    got: dict[str, Any] = {}

    def body(rank: int) -> None:
        if rank == 0:
            send_state(comms[0], moved(state, devs[0]), 1, tag=1)
        else:
            got["sd"] = recv_state(comms[1], 0, tag=1)

    run_ranks(comms, f"heal-{kind}", body)
    sd = got["sd"]
    assert sd["step"] == 7 and sd["rng"] == [1, 2, 3]
    tensors = [*sd["model"].values(), *sd["optimizer"]["state"][0].values()]
    assert {t.device for t in tensors} == {devs[1]}
    torch.testing.assert_close(sd["model"]["w"].cpu(), big)
    torch.testing.assert_close(sd["optimizer"]["state"][0]["exp_avg"].cpu(), big * 2)
    assert sd["model"]["b"].dtype == torch.float64


@pytest.mark.parametrize("kind", DEVICES)
def test_a_weight_sync_and_its_relay_broadcast_on_the_device(kind: str) -> None:
    from phalanx.comm.torch_pg import serve_store

    devs = rank_devices(kind, 3, 3)
    weights = {"a.weight": torch.randn(64, 32), "b.bias": torch.arange(5, dtype=torch.float64)}
    like = {k: torch.empty_like(v) for k, v in weights.items()}
    chans = [CollectiveWeightChannel(60.0, d) for d in devs]
    store, address = serve_store()
    results: list[SyncResult] = []
    fetched: dict[int, tuple[int, dict[str, torch.Tensor]]] = {}

    def first(rank: int) -> None:  # the policy leader sends version 3 to a rollout
        order = SyncOrder(seq=1, mesh_id=1, members=("p", "r1"), rank=rank, store=address)
        if rank == 0:
            chans[0].publish(3, weights, order, results.append)
            assert chans[0].pending is not None
            chans[0].pending.result(timeout=60)
        else:
            fetched[1] = chans[1].fetch(order, like)

    def relayed(rank: int) -> None:  # that rollout relays version 3 to a late joiner
        order = SyncOrder(seq=2, mesh_id=2, members=("r1", "r2"), rank=rank, store=address)
        if rank == 0:
            results.append(chans[1].relay(order, 3))
        else:
            fetched[2] = chans[2].fetch(order, like)

    try:
        run_threads(2, first)
        run_threads(2, relayed)
    finally:
        for c in chans:
            c.close()
        del store
    assert [r.ok for r in results] == [True, True], results
    for who in (1, 2):
        version, got = fetched[who]
        assert version == 3
        for k, v in weights.items():
            torch.testing.assert_close(got[k].cpu(), v)
    assert chans[1].kept is not None and chans[1].kept[2].device == devs[1]

"""The joiner's pre-faulted heal buffer: its size estimate matches the state a
stepped optimizer sends, and ``recv_state`` receives into it (or into new memory
when it is short) over a real gloo pair, bit for bit."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from rank_threads import run_ranks

from phalanx.comm.torch_pg import TorchCommunicator
from phalanx.comm.transfer import buffer_bytes, recv_state, send_state
from phalanx.train.heal import PrefaultedBuffer, expected_state_bytes, received_into
from phalanx.train.manager import rng_state


def model_and_optimizer(kind: str, seed: int = 0) -> tuple[torch.nn.Module, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(300, 70), torch.nn.ReLU(), torch.nn.Linear(70, 3))
    model[2].bias.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = {
        "adamw": lambda: torch.optim.AdamW(params, lr=1e-3),
        "adam_amsgrad": lambda: torch.optim.Adam(params, lr=1e-3, amsgrad=True),
        "sgd": lambda: torch.optim.SGD(params, lr=0.1),
        "sgd_momentum": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        "rmsprop_centered": lambda: torch.optim.RMSprop(params, centered=True, momentum=0.5),
    }[kind]()
    return model, opt


def state(model: torch.nn.Module, opt: Any) -> dict[str, Any]:
    """The tree Manager.state_dict() sends."""
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": 3,
        "sampler": {"epoch": 0, "cursor": 96},
        "rng": rng_state(),
        "extra": {},
    }


def step(model: torch.nn.Module, opt: Any) -> None:
    model(torch.randn(8, 300)).square().mean().backward()
    opt.step()


@pytest.mark.parametrize(
    "kind", ["adamw", "adam_amsgrad", "sgd", "sgd_momentum", "rmsprop_centered"]
)
def test_the_estimate_before_the_first_step_covers_the_state_after_it(kind: str):
    model, opt = model_and_optimizer(kind)
    before = expected_state_bytes(state(model, opt), opt)
    step(model, opt)
    actual = buffer_bytes(state(model, opt))
    # Never short (a short buffer is not used); long by no more than a few
    # alignment pads and a step counter per parameter.
    assert actual <= before <= actual + 3 * 64 * len(list(model.parameters()))
    # Once the state exists, the estimate is the size itself.
    assert expected_state_bytes(state(model, opt), opt) == actual


def stepped_state() -> dict[str, Any]:
    model, opt = model_and_optimizer("adamw", seed=1)
    step(model, opt)
    return state(model, opt)


def transfer(
    scratch: torch.Tensor | None, sent: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Send ``sent`` (a stepped AdamW state by default) from rank 0 to rank 1 over
    gloo; returns (sent, got)."""
    sent = sent if sent is not None else stepped_state()
    comms = [TorchCommunicator(20.0) for _ in range(2)]
    got: dict[str, Any] = {}

    def body(rank: int) -> None:
        if rank == 0:
            send_state(comms[0], sent, 1, tag=1)
        else:
            got.update(recv_state(comms[1], 0, tag=1, scratch=scratch))

    run_ranks(comms, "heal-test", body)
    return sent, got


def assert_same_state(sent: dict[str, Any], got: dict[str, Any]) -> None:
    for k, v in sent["model"].items():
        assert torch.equal(v, got["model"][k]), k
    for pid, st in sent["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, got["optimizer"]["state"][pid][k]), (pid, k)
    assert got["optimizer"]["param_groups"] == sent["optimizer"]["param_groups"]
    assert got["step"] == 3 and got["sampler"] == sent["sampler"]


def test_a_heal_receives_into_the_prefaulted_buffer():
    model, opt = model_and_optimizer("adamw", seed=1)
    pre = PrefaultedBuffer()
    pre.start(expected_state_bytes(state(model, opt), opt))  # before any step, as a joiner
    scratch = pre.take()
    pre.close()
    assert scratch is not None and pre.take() is None  # handed over once
    sent, got = transfer(scratch)
    assert_same_state(sent, got)
    assert received_into(got, scratch)


def test_a_short_buffer_is_left_alone_and_the_heal_uses_new_memory():
    short = torch.full((1024,), 7, dtype=torch.uint8)
    sent, got = transfer(short)
    assert_same_state(sent, got)
    assert not received_into(got, short)
    assert bool((short == 7).all())  # not written


def test_a_header_longer_than_the_preamble_arrives_whole():
    sent = stepped_state()
    sent["extra"] = {f"table.{i}": torch.full((3,), i) for i in range(600)}
    _, got = transfer(None, sent)
    assert_same_state(sent, got)
    assert all(torch.equal(v, got["extra"][k]) for k, v in sent["extra"].items())
    assert list(got["extra"]) == list(sent["extra"])

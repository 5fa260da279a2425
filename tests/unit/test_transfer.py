"""State trees travel as JSON + one raw buffer, never pickle."""

import random

import numpy as np
import pytest
import torch

from phalanx.comm.transfer import pack, unpack
from phalanx.train.grads import GradBuffer
from phalanx.train.manager import rng_state, set_rng_state


def test_model_optimizer_and_rng_state_round_trip_exactly():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3)
    ).double()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 5, dtype=torch.float64)).sum().backward()
    opt.step()
    tree = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "step": 7,
        "rng": rng_state(),
        "extra": {
            "scalar": torch.tensor(3.5),
            "empty": torch.empty(0, 4),
            "flag": True,
            "none": None,
        },
    }
    header, buf = pack(tree)
    assert b"pickle" not in header
    got = unpack(header, buf)
    for k, v in tree["model"].items():
        assert torch.equal(got["model"][k], v)
    assert (
        got["optimizer"]["param_groups"][0]["betas"] == opt.state_dict()["param_groups"][0]["betas"]
    )
    assert set(got["optimizer"]["state"]) == {0, 1, 2, 3}  # int keys kept
    for pid, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(got["optimizer"]["state"][pid][k], v)
    assert got["step"] == 7 and got["extra"]["flag"] is True and got["extra"]["none"] is None
    assert got["extra"]["empty"].shape == (0, 4)

    # The received RNG state reproduces the same draws.
    draws = (torch.rand(3), np.random.rand(), random.random())
    set_rng_state(got["rng"])
    again = (torch.rand(3), np.random.rand(), random.random())
    assert torch.equal(draws[0], again[0]) and draws[1:] == again[1:]

    # A fresh optimizer loads the received state.
    opt2 = torch.optim.AdamW(model.parameters(), lr=0.1)
    opt2.load_state_dict(got["optimizer"])


def test_truncated_buffer_is_detected():
    header, buf = pack({"w": torch.ones(100)})
    with pytest.raises(ValueError, match="truncated"):
        unpack(header, buf[:10])


def test_unsupported_values_are_refused():
    with pytest.raises(TypeError, match="state must hold only"):
        pack({"f": object()})


def test_grads_accumulate_in_place_into_the_flat_buffer():
    model = torch.nn.Linear(3, 2)
    g = GradBuffer(model, bucket_bytes=8)  # tiny buckets: several slices
    assert len(g.buckets) > 1
    x = torch.randn(4, 3)
    model(x).sum().backward()
    model(x).sum().backward()
    assert torch.equal(model.weight.grad, g.views[0][1])
    assert torch.allclose(g.flats[0][:6].view(2, 3), 2 * x.sum(0).expand(2, 3))
    model.zero_grad(set_to_none=True)
    g.zero()  # re-binds the views after set_to_none
    model(x).sum().backward()
    assert model.weight.grad.data_ptr() == g.views[0][1].data_ptr()

"""The built-in FT task (phalanx.jobs.task): the transformer's ``compute`` is the
mean next-token loss per sample, summed and scaled, and an empty micro-batch
still runs forward and backward when asked (a sharded model's ranks need it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F  # noqa: N812

from phalanx.config import load_config
from phalanx.jobs import task

CFG = load_config(
    overrides=[
        "train.model=transformer",
        "train.dtype=float64",
        "train.vocab=16",
        "train.seq=8",
        "train.d_model=16",
        "train.n_heads=2",
        "train.dataset_size=64",
    ]
)


def test_the_transformer_loss_is_the_mean_next_token_loss_summed_over_samples() -> None:
    tc = CFG.train
    model = task.build_model(tc, 3)
    compute = task.make_compute(tc, model, 3)
    got = compute([1, 5, 9], 0.5)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    rows = task.build_tokens(tc, 3)[[1, 5, 9]]
    logits = model(rows[:, :-1])
    want = 3 * F.cross_entropy(logits.reshape(-1, tc.vocab), rows[:, 1:].reshape(-1))
    (0.5 * want).backward()
    assert abs(got - float(want.detach())) < 1e-12
    for n, p in model.named_parameters():
        assert torch.allclose(grads[n], p.grad, atol=1e-12), n


def test_counting_rows_step_by_a_stride_mod_the_vocabulary() -> None:
    rows = task.build_tokens(CFG.train, 0)
    steps = (rows[:, 1:] - rows[:, :-1]) % CFG.train.vocab
    assert rows.shape == (64, 9) and bool((steps == steps[:, :1]).all())


def test_an_empty_micro_batch_runs_forward_only_when_asked() -> None:
    tc = CFG.train
    model = task.build_model(tc, 0)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    assert task.make_compute(tc, model, 0)([], 1.0) == 0.0 and not calls
    assert task.make_compute(tc, model, 0, always_forward=True)([], 1.0) == 0.0 and calls

"""Off-policy corrections of the GRPO surrogate (decoupled PPO, TIS, MIS) and the
off-policy metrics, against hand-computed values on 2 completions x 3 tokens."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from phalanx.config import ConfigError
from phalanx.config.rl import CORRECTIONS, GRPOSection, ModelSection, load_rl_config
from phalanx.protocol.rl import BatchMetrics
from phalanx.rl.corrections import ess, staleness_histogram, surrogate
from phalanx.rl.engine.base import Completion
from phalanx.rl.grpo import collate, grpo_loss, token_logprobs
from phalanx.rl.model import build_model
from phalanx.rl.step import backward_rows, merge_stats
from phalanx.rl.tokenizer import CharTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

TOK = CharTokenizer()

# d = log pi_prox - log mu per token; row 0 has A = +1, row 1 has A = -2. C = 2, so
# log C = 0.693: d = 1.0 is truncated; exp(-0.9) and exp(-1.5) are below 1/C.
D = [[0.1, 1.0, -0.2], [-0.9, -1.5, 0.1]]
LOGP = [[-1.0, -0.5, -2.0], [-1.3, -0.7, -0.4]]
ADV = [1.0, -2.0]
N = 6
E = math.exp


def _inputs() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    old = torch.tensor(
        [[lp - d for lp, d in zip(lr, dr, strict=True)] for lr, dr in zip(LOGP, D, strict=True)],
        dtype=torch.float64,
    )
    return logp, old, torch.tensor(ADV, dtype=torch.float64), torch.ones(2, 3, dtype=torch.float64)


def _run(correction: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    logp, old, adv, mask = _inputs()
    per_token, stats = surrogate(
        logp, old, adv, mask, correction=correction, clip_eps=0.2, is_cap=2.0
    )
    loss = (per_token * mask).sum() / N
    loss.backward()
    assert logp.grad is not None
    return loss.detach(), logp.grad, stats


def _weighted(w: list[list[float]]) -> tuple[float, list[list[float]]]:
    """Loss and d loss / d logp of sum_t -w_t A_i r_t / N at r = 1 (the clip is inactive):
    the value is -w A / N per token, and so is the gradient (d r / d logp = r = 1)."""
    g = [[-w[i][t] * ADV[i] / N for t in range(3)] for i in range(2)]
    return sum(map(sum, g)), g


# Hand-computed weights of each correction (module docstring of rl.corrections).
WEIGHTS = {
    # min(exp(d), 2): only d = 1.0 is truncated.
    "tis_token": [[E(0.1), 2.0, E(-0.2)], [E(-0.9), E(-1.5), E(0.1)]],
    # min(exp(sum d), 2): row 0 sums to 0.9 (exp 2.46, truncated), row 1 to -2.3.
    "tis_sequence": [[2.0] * 3, [E(-2.3)] * 3],
    # exp(d) kept only within [1/2, 2]: exp(1.0), exp(-0.9) and exp(-1.5) are dropped.
    "mis_token": [[E(0.1), 0.0, E(-0.2)], [0.0, 0.0, E(0.1)]],
    # The geometric mean exp(mean d): row 0 exp(0.3) kept, row 1 exp(-0.767) < 1/2 dropped.
    "mis_sequence": [[E(0.3)] * 3, [0.0] * 3],
}
# exp(d) with the token over the cap (d = 1.0) dropped, as AReaL does.
WEIGHTS["decoupled"] = [[E(0.1), 0.0, E(-0.2)], [E(-0.9), E(-1.5), E(0.1)]]
IS_FRACS = {
    "tis_token": (1 / 6, 0.0),
    "decoupled": (0.0, 1 / 6),
    "tis_sequence": (3 / 6, 0.0),
    "mis_token": (0.0, 3 / 6),
    "mis_sequence": (0.0, 3 / 6),
}


@pytest.mark.parametrize("correction", sorted(WEIGHTS))
def test_correction_loss_and_gradient_by_hand(correction):
    loss, grad, stats = _run(correction)
    want_loss, want_grad = _weighted(WEIGHTS[correction])
    torch.testing.assert_close(
        loss, torch.tensor(want_loss, dtype=torch.float64), rtol=0, atol=1e-12
    )
    torch.testing.assert_close(
        grad, torch.tensor(want_grad, dtype=torch.float64), rtol=0, atol=1e-12
    )
    clip_w, masked = IS_FRACS[correction]
    assert stats["is_clip_frac"] == pytest.approx(clip_w, abs=1e-12)
    assert stats["is_mask_frac"] == pytest.approx(masked, abs=1e-12)
    assert stats["clip_frac"] == 0.0  # r = pi_theta / pi_prox is 1: the clip never acts


def test_none_by_hand_and_equal_to_the_old_formula():
    loss, grad, stats = _run("none")
    # rho = exp(d) against mu, band [0.8, 1.2]. Row 0 (A = 1): e^1.0 > 1.2 is clipped
    # (value -1.2, no gradient). Row 1 (A = -2): e^-0.9 and e^-1.5 < 0.8 are clipped
    # (value 0.8 * 2 = 1.6 each, no gradient); the others give -rho A with gradient -rho A.
    want = [[-E(0.1), -1.2, -E(-0.2)], [1.6, 1.6, 2 * E(0.1)]]
    want_grad = [[-E(0.1) / N, 0.0, -E(-0.2) / N], [0.0, 0.0, 2 * E(0.1) / N]]
    torch.testing.assert_close(loss, torch.tensor(sum(map(sum, want)) / N, dtype=torch.float64))
    torch.testing.assert_close(
        grad, torch.tensor(want_grad, dtype=torch.float64), rtol=0, atol=1e-12
    )
    assert stats["clip_frac"] == pytest.approx(3 / 6)
    assert stats["is_clip_frac"] == stats["is_mask_frac"] == 0.0

    # Bit for bit the loss before corrections existed (float32, a padded column).
    logp = torch.tensor([[-1.0, -0.5, -2.0], [-1.3, -0.7, -9.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.5, -1.8], [-0.4, 0.8, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -2.0])
    per_token, _ = surrogate(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.4)
    new = (per_token * mask).sum() / 5.0
    (g_new,) = torch.autograd.grad(new, logp)
    ratio = torch.exp((logp - old) * mask)
    a = adv[:, None]
    surr = torch.minimum(ratio * a, torch.clamp(ratio, 1 - 0.2, 1 + 0.4) * a)
    before = (-surr * mask).sum() / 5.0
    (g_before,) = torch.autograd.grad(before, logp)
    assert torch.equal(new, before)
    assert torch.equal(g_new, g_before)


def test_metrics_by_hand():
    *_, stats = _run("tis_token")
    w = [E(d) for row in D for d in row]
    assert stats["mismatch_kl"] == pytest.approx(
        sum(E(d) - d - 1 for row in D for d in row) / N, abs=1e-12
    )
    assert stats["is_w_sum"] == pytest.approx(sum(w), abs=1e-12)
    assert stats["is_w_sq_sum"] == pytest.approx(sum(x * x for x in w), abs=1e-12)
    assert stats["ess"] == pytest.approx(sum(w) ** 2 / (N * sum(x * x for x in w)), abs=1e-12)
    # The diagnostics do not depend on the correction.
    for correction in CORRECTIONS:
        other = _run(correction)[2]
        for k in ("mismatch_kl", "ess", "is_w_sum", "is_w_sq_sum"):
            assert other[k] == stats[k]
    assert ess(3.0, 3.0, 3.0) == 1.0 and ess(0.0, 0.0, 0.0) == 1.0


def test_off_mask_columns_cannot_overflow():
    logp = torch.tensor([[-0.5, 80.0]], requires_grad=True)
    old = torch.tensor([[-0.7, 0.0]])
    mask = torch.tensor([[1.0, 0.0]])
    for correction in CORRECTIONS:
        per_token, stats = surrogate(logp, old, torch.tensor([1.0]), mask, correction=correction)
        loss = (per_token * mask).sum()
        (g,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(g).all(), correction
        assert math.isfinite(stats["ess"]) and stats["ess"] == 1.0


def test_merged_ess_is_the_whole_batch_ess():
    _, _, whole = _run("none")
    parts = []
    for i in range(2):
        logp, old, adv, mask = _inputs()
        _, s = surrogate(logp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1])
        parts.append({**s, "loss": 0.0, "num_tokens": 3.0, "ratio_max": 1.0})
    merged = merge_stats(parts, with_ref=False)
    assert parts[0]["ess"] != pytest.approx(whole["ess"])
    assert merged["ess"] == pytest.approx(whole["ess"], rel=1e-12)
    assert merged["mismatch_kl"] == pytest.approx(whole["mismatch_kl"], rel=1e-12)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(ModelSection(seed=1), TOK).train()


def _stale_batch(model) -> tuple[list[Completion], torch.Tensor]:
    """Completions whose behaviour log-probs are the model's, shifted per token (stale)."""
    rows = [("3142>", [4, 5, 6, 7, TOK.eos_id]), ("90>", [3, TOK.eos_id]), ("5>", [8, 8, 8])]
    rows += [("71>", [10, 4, TOK.eos_id]), ("26>", [5, 9])]
    comps = [
        Completion(i, TOK.encode(p), t, [0.0] * len(t), True, version=0)
        for i, (p, t) in enumerate(rows)
    ]
    batch = collate(comps, [0.0] * len(comps), TOK.pad_id)
    with torch.no_grad():
        lp = token_logprobs(model, batch)
    for i, c in enumerate(comps):
        cols = batch.completion_mask[i].nonzero().squeeze(1)
        # Mixed per-token shifts of +-0.6, and row 3 wholly behind (d = 0.8 throughout).
        shift = torch.tensor([0.6 * ((i + t) % 3 - 1) for t in range(len(cols))])
        if i == 3:
            shift = torch.full((len(cols),), -0.8)
        c.logprobs = (lp[i, cols] + shift).clamp(max=0.0).tolist()
    return comps, torch.tensor([1.0, -0.5, 0.7, -1.2, 0.4])


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_micro_batches_accumulate_to_the_unsplit_step(model, correction):
    """Every correction is row-local: split micro-batches give the whole step's
    gradient, and the merged stats (ESS from the merged sums) the whole step's."""
    comps, adv = _stale_batch(model)
    n = sum(len(c.token_ids) for c in comps)
    out = []
    for size in (0, 2):
        model.zero_grad(set_to_none=True)
        g = GRPOSection(correction=correction, is_cap=1.5, micro_batch_size=size)
        stats = backward_rows(
            model, comps, adv, list(range(5)), g=g, pad_id=TOK.pad_id, num_tokens=n
        )
        out.append(([p.grad.clone() for p in model.parameters()], stats))
    (whole, s_whole), (split, s_split) = out
    for a, b in zip(whole, split, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    for k in ("ess", "mismatch_kl", "is_clip_frac", "is_mask_frac", "clip_frac"):
        assert s_split[k] == pytest.approx(s_whole[k], rel=1e-6, abs=1e-9), k
    assert 0 < s_whole["ess"] < 1 and s_whole["mismatch_kl"] > 0
    if correction.startswith(("mis", "decoupled")):
        assert s_whole["is_mask_frac"] > 0
    if correction.startswith("tis"):
        assert s_whole["is_clip_frac"] > 0


def test_corrections_are_the_policy_gradient_on_policy(model):
    """On fresh rollouts (mu = pi_theta) every weight is 1: each correction's gradient
    is the uncorrected one."""
    comps, adv = _stale_batch(model)
    batch = collate(comps, adv, TOK.pad_id)
    with torch.no_grad():
        batch.old_logprobs = token_logprobs(model, batch) * batch.completion_mask
    ref = None
    for correction in CORRECTIONS:
        loss, stats = grpo_loss(model, batch, correction=correction)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        assert stats["ess"] == pytest.approx(1.0) and stats["is_mask_frac"] == 0.0
        if ref is None:
            ref = grads
        for a, b in zip(ref, grads, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_staleness_histogram_uses_per_token_versions_when_present():
    plain = SimpleNamespace(token_ids=[1, 2, 3])
    spanning = SimpleNamespace(token_ids=[1, 2, 3, 4], versions=[5, 5, 6, 7])
    empty = SimpleNamespace(token_ids=[9, 9], versions=[])
    hist = staleness_histogram([(5, plain), (5, spanning), (4, empty)], 7)
    assert hist == {0: 1, 1: 1, 2: 5, 3: 2}
    assert list(hist) == sorted(hist)
    done = Completion(0, [1], [2, 3], [-0.1, -0.2], True, version=3)
    assert staleness_histogram([(3, done)], 3) == {0: 2}


def test_batch_metrics_carry_the_histogram_over_the_wire():
    m = BatchMetrics(
        ess=0.8, mismatch_kl=0.01, is_mask_frac=0.25, staleness_tokens={"0": 9, "-1": 4}
    )
    assert BatchMetrics.model_validate_json(m.model_dump_json()) == m
    # The server's route validates the parsed body in strict Python mode too.
    assert BatchMetrics.model_validate(json.loads(m.model_dump_json())) == m
    with pytest.raises(ValidationError):
        BatchMetrics.model_validate({"staleness_tokens": {"one": 3}})


def _config_error(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load_rl_config(None, list(overrides))
    assert "\n" not in str(e.value)
    return str(e.value).split(": ", 1)


def test_config_refuses_a_cap_of_one_or_less_in_one_line():
    for bad in ("1.0", "0.5"):
        head, line = _config_error("--grpo.is_cap", bad)
        assert head.startswith("invalid rl config")
        assert "rl.grpo.is_cap must be > 1" in line and f"got {float(bad)}" in line


def test_config_refuses_an_unknown_correction_in_one_line():
    head, line = _config_error("--grpo.correction", "tis")
    assert head.startswith("invalid rl config")
    assert "rl.grpo.correction must be one of" in line and "got 'tis'" in line
    assert all(c in line for c in CORRECTIONS)
    g = load_rl_config(None, ["--grpo.correction", "mis_sequence", "--grpo.is_cap", "3"]).grpo
    assert (g.correction, g.is_cap) == ("mis_sequence", 3.0)
    assert GRPOSection().correction == "none"


def test_config_refuses_less_staleness_than_generation_ahead_needs_in_one_line():
    """max_ahead batches leased ahead are max_ahead x inner_epochs versions old when the
    furthest one trains: less staleness than that is refused, naming both fixes."""
    head, line = _config_error(
        "--loop.max_ahead", "3", "--loop.max_staleness", "5", "--grpo.inner_epochs", "2"
    )
    assert head.startswith("invalid rl config")
    assert "rl.loop.max_staleness must be >= rl.loop.max_ahead x rl.grpo.inner_epochs = 6" in line
    assert "got 5" in line and "rl.loop.max_staleness = 6, or rl.loop.max_ahead = 2" in line
    # The synchronous setting asks for no generation ahead (max_ahead = 1).
    _, line = _config_error("--loop.max_staleness", "0", "--loop.sync_every", "1")
    assert "got 0" in line and "rl.loop.max_ahead = 1." in line
    for ahead, stale, epochs in (("3", "6", "2"), ("1", "0", "2"), ("4", "4", "1")):
        args = ["--loop.max_ahead", ahead, "--loop.max_staleness", stale]
        args += ["--loop.sync_every", "1", "--grpo.inner_epochs", epochs]
        loop = load_rl_config(None, args).loop
        assert (loop.max_ahead, loop.max_staleness) == (int(ahead), int(stale))


def test_a_recorded_proximal_policy_makes_the_clip_act_by_hand():
    """On a batch's later inner epoch pi_prox is the batch's first step's: r = pi_theta /
    pi_prox departs from 1, the PPO clip acts on it, and w = min(pi_prox / mu, C)."""
    logp, old, adv, mask = _inputs()
    # log pi_theta - log pi_prox per token, so r = exp(delta): band [0.8, 1.2].
    delta = [[0.1, 0.3, -0.5], [0.0, 0.25, -0.1]]
    prox = (logp.detach() - torch.tensor(delta, dtype=torch.float64)).clone()
    per_token, stats = surrogate(
        logp, old, adv, mask, correction="tis_token", clip_eps=0.2, is_cap=2.0, prox=prox
    )
    loss = (per_token * mask).sum() / N
    loss.backward()
    # w = min(exp(d - delta), 2): d - delta = [[0, 0.7, 0.3], [-0.9, -1.75, 0.2]].
    w = [[1.0, 2.0, E(0.3)], [E(-0.9), E(-1.75), E(0.2)]]
    r = [[E(x) for x in row] for row in delta]
    # Row 0 (A = 1): r = 1.35 is clipped at 1.2 (no gradient); 0.607 < 0.8 keeps r
    # (min picks it). Row 1 (A = -2): r = 1.284 keeps r A = -2.568 < -2.4.
    surr = [[r[0][0], 1.2, r[0][2]], [-2 * r[1][0], -2 * r[1][1], -2 * r[1][2]]]
    want = sum(-w[i][t] * surr[i][t] for i in range(2) for t in range(3)) / N
    grad = [[-w[0][0] * r[0][0] / N, 0.0, -w[0][2] * r[0][2] / N]]
    grad += [[2 * w[1][t] * r[1][t] / N for t in range(3)]]
    torch.testing.assert_close(loss.detach(), torch.tensor(want, dtype=torch.float64))
    assert logp.grad is not None
    torch.testing.assert_close(
        logp.grad, torch.tensor(grad, dtype=torch.float64), rtol=0, atol=1e-12
    )
    assert stats["clip_frac"] == pytest.approx(1 / 6)  # the clip acted on one token
    assert stats["is_clip_frac"] == pytest.approx(1 / 6)  # exp(0.7) > 2 was truncated
    # A row without a record (NaN) takes the step's own forward: r = 1 there.
    logp.grad = None
    prox[1] = float("nan")
    per_token, _ = surrogate(logp, old, adv, mask, correction="tis_token", is_cap=2.0, prox=prox)
    ((per_token * mask).sum() / N).backward()
    own = [2 * min(E(d), 2.0) / N for d in D[1]]
    torch.testing.assert_close(
        logp.grad[1], torch.tensor(own, dtype=torch.float64), rtol=0, atol=1e-12
    )


def test_inner_epochs_train_against_the_batch_first_step(model):
    """backward_rows with a Proximal: the first epoch records pi_prox, the second is
    clipped against it (not against its own weights), whatever the micro-batching; a
    completion that is not the recorded one at its index is not given its record."""
    import copy

    from phalanx.rl.step import Proximal

    comps, adv = _stale_batch(model)
    model = copy.deepcopy(model)  # this test steps it: the module's model stays as it was
    n = sum(len(c.token_ids) for c in comps)
    g = GRPOSection(correction="tis_token", lr=0.05, micro_batch_size=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    prox = Proximal()
    prox.start(7)
    first = backward_rows(
        model, comps, adv, list(range(5)), g=g, pad_id=TOK.pad_id, num_tokens=n, proximal=prox
    )
    assert first["clip_frac"] == 0.0 and sorted(prox.rows) == [0, 1, 2, 3, 4]
    opt.step()
    model.zero_grad(set_to_none=True)
    second = backward_rows(
        model, comps, adv, list(range(5)), g=g, pad_id=TOK.pad_id, num_tokens=n, proximal=prox
    )
    assert second["clip_frac"] > 0  # the step moved the policy past the band on some tokens
    # The per-step proximal (no record) would not clip at all.
    model.zero_grad(set_to_none=True)
    alone = backward_rows(model, comps, adv, list(range(5)), g=g, pad_id=TOK.pad_id, num_tokens=n)
    assert alone["clip_frac"] == 0.0
    # Another batch, or another completion at a recorded index, starts unrecorded.
    other = Completion(0, comps[1].prompt_ids, comps[1].token_ids, comps[1].logprobs, True, 0)
    batch = collate([other], [1.0], TOK.pad_id)
    assert prox.tensor([other], [0], batch) is None
    prox.start(8)
    assert prox.rows == {}

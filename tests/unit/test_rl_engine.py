"""The HF engine: behaviour log-probs, KV-cached decoding, EOS handling, weight loading."""

from __future__ import annotations

import copy

import pytest
import torch

from phalanx.config.rl import ModelSection
from phalanx.rl.engine.base import prompt_key
from phalanx.rl.engine.hf import HFEngine
from phalanx.rl.model import build_model, num_params
from phalanx.rl.tokenizer import CharTokenizer

TOK = CharTokenizer()
# Different lengths, so that the batch is left-padded.
PROMPTS = [TOK.encode(p) for p in ("3142>", "90>", "7>", "55012>")]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def model(request):
    return build_model(ModelSection(arch=request.param, seed=7), TOK)


def _teacher_forced(model, prompt, tokens, temperature):
    """log softmax(logits / T) of each completion token, one unpadded, uncached forward."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[0].float()
    lp = torch.log_softmax(logits / temperature, -1)
    return [lp[len(prompt) - 1 + k, t].item() for k, t in enumerate(tokens)]


def test_model_is_tiny_and_deterministic(model):
    arch = "gpt2" if "GPT2" in type(model).__name__ else "llama"
    again = build_model(ModelSection(arch=arch, seed=7), TOK)
    other = build_model(ModelSection(arch=arch, seed=8), TOK)
    sd, sd2, sd3 = model.state_dict(), again.state_dict(), other.state_dict()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert any(not torch.equal(sd[k], sd3[k]) for k in sd if sd[k].dtype.is_floating_point)
    assert 50_000 < num_params(model) < 200_000


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_teacher_forced_logprobs(model, temperature):
    """The key identity behind the importance ratio: what the engine records for a
    sampled token is what a training forward computes for it."""
    engine = HFEngine(model, TOK.eos_id, TOK.pad_id, seed=1)
    comps = engine.generate(PROMPTS, n=3, max_new_tokens=6, temperature=temperature)
    assert len(comps) == len(PROMPTS) * 3
    for i, c in enumerate(comps):
        assert c.prompt_index == i // 3 and c.prompt_ids == PROMPTS[i // 3]
        assert len(c.logprobs) == len(c.token_ids) >= 1
        expected = _teacher_forced(model, c.prompt_ids, c.token_ids, temperature)
        assert c.logprobs == pytest.approx(expected, abs=1e-5)


def test_cached_greedy_equals_uncached_argmax(model):
    engine = HFEngine(model, TOK.eos_id, TOK.pad_id)
    comps = engine.generate(PROMPTS, n=2, max_new_tokens=8, temperature=0.0)
    for c in comps:
        ids = list(c.prompt_ids)
        out = []
        with torch.no_grad():
            for _ in range(8):
                nxt = int(
                    model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()
                )
                out.append(nxt)
                ids.append(nxt)
                if nxt == TOK.eos_id:
                    break
        assert c.token_ids == out


def test_generation_stops_at_eos_per_sequence(model):
    greedy = HFEngine(model, TOK.eos_id, TOK.pad_id).generate(PROMPTS, 1, 6, 0.0)
    # Declare the 2nd greedy token of prompt 0 the EOS: prompt 0 stops there, the
    # others stop at their own first occurrence of it, or run to max_new_tokens.
    eos = greedy[0].token_ids[1]
    comps = HFEngine(model, eos, TOK.pad_id).generate(PROMPTS, 1, 6, 0.0)
    for c, g in zip(comps, greedy, strict=True):
        if eos in g.token_ids:
            end = g.token_ids.index(eos) + 1
            assert c.token_ids == g.token_ids[:end] and c.finished
        else:
            assert c.token_ids == g.token_ids and not c.finished
    assert comps[0].finished and len(comps[0].token_ids) <= 2


def test_sampling_is_seeded(model):
    a = HFEngine(model, TOK.eos_id, TOK.pad_id, seed=3).generate(PROMPTS, 4, 5, 1.0)
    b = HFEngine(model, TOK.eos_id, TOK.pad_id, seed=3).generate(PROMPTS, 4, 5, 1.0)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]


def test_load_weights_sets_weights_and_version(model):
    arch = "gpt2" if "GPT2" in type(model).__name__ else "llama"
    engine = HFEngine(build_model(ModelSection(arch=arch, seed=99), TOK), TOK.eos_id, TOK.pad_id)
    assert engine.version == -1
    engine.load_weights(model.state_dict(), version=5)
    assert engine.version == 5
    want = HFEngine(model, TOK.eos_id, TOK.pad_id).generate(PROMPTS, 1, 5, 0.0)
    got = engine.generate(PROMPTS, 1, 5, 0.0)
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert all(c.version == 5 for c in got)
    # A stream of (name, tensor) pairs may be partial.
    name, tensor = next(iter(model.state_dict().items()))
    engine.load_weights([(name, torch.zeros_like(tensor))], version=6)
    assert engine.version == 6
    assert torch.count_nonzero(engine.model.state_dict()[name]) == 0


def test_load_weights_errors(model):
    engine = HFEngine(copy.deepcopy(model), TOK.eos_id, TOK.pad_id, version=2)
    sd = model.state_dict()
    name = next(iter(sd))
    with pytest.raises(ValueError, match="full state dict when given as a mapping"):
        engine.load_weights({name: sd[name]}, version=3)
    with pytest.raises(ValueError, match="got 'nope'"):
        engine.load_weights([("nope", torch.zeros(1))], version=3)
    with pytest.raises(ValueError, match=f"weight {name} must have the engine's shape"):
        engine.load_weights({**sd, name: torch.zeros(1, 1)}, version=3)
    assert engine.version == 2


def test_generate_argument_errors(model):
    engine = HFEngine(model, TOK.eos_id, TOK.pad_id)
    with pytest.raises(ValueError, match="non-empty list of non-empty token lists"):
        engine.generate([[]], 1, 1)
    with pytest.raises(ValueError, match="n and max_new_tokens must be >= 1"):
        engine.generate(PROMPTS, 0, 1)
    with pytest.raises(ValueError, match="temperature must be in"):
        engine.generate(PROMPTS, 1, 1, temperature=-1.0)


def test_keyed_sampling_depends_on_the_prompt_key_alone(model):
    keys = [prompt_key(0, i) for i in range(len(PROMPTS))]
    # Two engines with different own seeds, the prompts batched differently.
    whole = HFEngine(model, TOK.eos_id, TOK.pad_id, seed=1).generate(PROMPTS, 3, 5, 1.0, keys)
    engine = HFEngine(model, TOK.eos_id, TOK.pad_id, seed=2)
    parts = engine.generate(PROMPTS[2:], 3, 5, 1.0, keys[2:]) + engine.generate(
        PROMPTS[:2], 3, 5, 1.0, keys[:2]
    )
    parts = parts[6:] + parts[:6]
    assert [c.token_ids for c in whole] == [c.token_ids for c in parts]
    flat = [lp for c in parts for lp in c.logprobs]
    assert [lp for c in whole for lp in c.logprobs] == pytest.approx(flat, abs=1e-5)
    # Another key draws something else; the samples of one prompt differ.
    other = engine.generate(PROMPTS[:1], 3, 5, 1.0, [prompt_key(1, 0)])
    assert [c.token_ids for c in other] != [c.token_ids for c in whole[:3]]
    assert len({tuple(c.token_ids) for c in whole[:3]}) > 1


def test_keyed_sampling_draws_from_the_model_distribution():
    # One step, a known distribution: the keyed inverse-CDF draw's frequencies.
    logits = torch.log(torch.tensor([[0.5, 0.0, 0.3, 0.2]])).expand(4000, 4)
    model = build_model(ModelSection(arch="gpt2", seed=7), TOK)
    engine = HFEngine(model, TOK.eos_id, TOK.pad_id)
    u = torch.rand(4000, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    tok, lp = engine._sample(logits, 1.0, u)
    freq = torch.bincount(tok, minlength=4).double() / 4000
    assert freq[1] == 0
    assert freq.tolist() == pytest.approx([0.5, 0.0, 0.3, 0.2], abs=0.03)
    assert torch.allclose(lp, logits.log_softmax(-1).gather(1, tok[:, None]).squeeze(1))


def test_keys_must_match_the_prompts(model):
    engine = HFEngine(model, TOK.eos_id, TOK.pad_id)
    with pytest.raises(ValueError, match="one sampling key per prompt"):
        engine.generate(PROMPTS, 1, 1, 1.0, keys=[1])

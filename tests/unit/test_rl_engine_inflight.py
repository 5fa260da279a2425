"""In-flight weight updates in the HF engine: a generation that spans a weight load
records each token's behaviour version, and each token's log-prob is the trainer's
under the model of that version (the KV cache is recomputed at the update)."""

from __future__ import annotations

import copy

import pytest
import torch

from phalanx.config.rl import ModelSection, RLConfig
from phalanx.protocol.rl import BatchRollout, PromptRef, RolloutPayload
from phalanx.rl.engine.base import Completion, EngineError, prompt_key
from phalanx.rl.engine.hf import HFEngine
from phalanx.rl.generate import make_rollouts
from phalanx.rl.grpo import collate, token_logprobs
from phalanx.rl.model import build_model
from phalanx.rl.tasks import task_from_config
from phalanx.rl.tokenizer import CharTokenizer, task_tokenizer
from phalanx.rl.trainer import check_payload, completions_of

TOK = CharTokenizer()
PROMPTS = [TOK.encode(p) for p in ("3142>", "90>", "7>", "55012>")]
KEYS = [prompt_key(3, i) for i in range(len(PROMPTS))]
CHUNK, STEPS, T = 4, 12, 0.9

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def models(request):
    """Version 1's and version 2's models (two seeds: far apart weights)."""
    return tuple(build_model(ModelSection(arch=request.param, seed=s), TOK) for s in (7, 8))


def load_after(engine: HFEngine, calls: int, weights, version: int):
    """A ``between`` hook that loads ``weights`` as ``version`` at its ``calls``-th call."""
    seen = []

    def hook() -> None:
        seen.append(engine.version)
        if len(seen) == calls:
            engine.load_weights(weights, version)

    return hook, seen


def trainer_logprobs(model, comps: list[Completion]) -> list[list[float]]:
    """What the trainer computes for each completion token (``grpo.token_logprobs``)."""
    batch = collate(comps, [0.0] * len(comps), TOK.pad_id)
    with torch.no_grad():
        lp = token_logprobs(model, batch, T)
    return [
        [lp[i, len(c.prompt_ids) - 1 + k].item() for k in range(len(c.token_ids))]
        for i, c in enumerate(comps)
    ]


def generate(engine: HFEngine, hook=None) -> list[Completion]:
    return engine.generate(
        PROMPTS, n=2, max_new_tokens=STEPS, temperature=T, keys=KEYS, between=hook
    )


def test_tokens_after_an_update_carry_the_new_version_and_the_trainer_logprob(models):
    old, new = models
    engine = HFEngine(copy.deepcopy(old), TOK.eos_id, TOK.pad_id, version=1, chunk=CHUNK)
    hook, seen = load_after(engine, 2, new.state_dict(), 2)  # after 2 chunks: 8 tokens
    comps = generate(engine, hook)
    assert seen[:2] == [1, 1] and set(seen[2:]) <= {2} and engine.version == 2
    spanning = [c for c in comps if len(c.token_ids) > 2 * CHUNK]
    assert spanning, "every row ended before the update: pick other prompts or keys"
    for c in comps:
        v = c.token_versions()
        assert c.version == 1 and v == [1 if k < 2 * CHUNK else 2 for k in range(len(v))]
        assert (c.versions == v) == (c in spanning)  # listed only when they differ
    # Each token's recorded log-prob is the trainer's under its own version's model:
    # exact, because the cache was prefilled again under the new weights.
    under = {1: trainer_logprobs(old, comps), 2: trainer_logprobs(new, comps)}
    for i, c in enumerate(comps):
        for k, (lp, ver) in enumerate(zip(c.logprobs, c.token_versions(), strict=True)):
            assert lp == pytest.approx(under[ver][i][k], abs=1e-5), (i, k, ver)
    # And not the other version's: the check above tells the two apart.
    c = spanning[0]
    i = comps.index(c)
    assert abs(c.logprobs[-1] - under[1][i][-1]) > 1e-4


def test_a_kept_cache_matches_neither_version_after_the_update(models):
    """``recompute_kv_on_update = False`` (PipelineRL's choice): the recorded log-probs
    are what the tokens were drawn with, but no single model gives them."""
    old, new = models
    engine = HFEngine(
        copy.deepcopy(old), TOK.eos_id, TOK.pad_id, version=1, chunk=CHUNK,
        recompute_kv_on_update=False,
    )  # fmt: skip
    hook, _ = load_after(engine, 2, new.state_dict(), 2)
    comps = [c for c in generate(engine, hook) if len(c.token_ids) > 2 * CHUNK + 1]
    under_new = trainer_logprobs(new, comps)
    under_old = trainer_logprobs(old, comps)
    for i, c in enumerate(comps):
        assert c.logprobs[: 2 * CHUNK] == pytest.approx(under_old[i][: 2 * CHUNK], abs=1e-5)
    # The token right after the update sees new weights on new input, old cache: it
    # differs from the new model's log-prob on at least one row.
    k = 2 * CHUNK + 1
    assert max(abs(c.logprobs[k] - under_new[i][k]) for i, c in enumerate(comps)) > 1e-4


def test_keyed_generation_is_deterministic_given_the_update_points(models):
    old, new = models
    runs = []
    for _ in range(2):
        engine = HFEngine(copy.deepcopy(old), TOK.eos_id, TOK.pad_id, version=1, chunk=CHUNK)
        runs.append(generate(engine, load_after(engine, 1, new.state_dict(), 2)[0]))
    assert [(c.token_ids, c.logprobs, c.versions) for c in runs[0]] == [
        (c.token_ids, c.logprobs, c.versions) for c in runs[1]
    ]
    # Before the update, the same tokens as a generation that never updates.
    plain = generate(HFEngine(copy.deepcopy(old), TOK.eos_id, TOK.pad_id, version=1))
    for a, b in zip(runs[0], plain, strict=True):
        assert a.token_ids[:CHUNK] == b.token_ids[:CHUNK] and not b.versions


def test_a_hook_that_loads_nothing_changes_nothing(models):
    old, _ = models
    engine = HFEngine(copy.deepcopy(old), TOK.eos_id, TOK.pad_id, version=1, chunk=1)
    hook, seen = load_after(engine, 0, {}, 0)  # never loads
    with_hook = generate(engine, hook)
    without = generate(HFEngine(copy.deepcopy(old), TOK.eos_id, TOK.pad_id, version=1))
    assert len(seen) >= STEPS - 1 - 1  # once per token but the last (rows may end early)
    assert [(c.token_ids, c.logprobs, c.versions, c.version) for c in with_hook] == [
        (c.token_ids, c.logprobs, c.versions, c.version) for c in without
    ]


def test_a_load_that_fails_part_way_abandons_the_generation(models):
    """No mixed weights under a version: the stream breaks after its first tensor, the
    engine holds version -1, and the generation raises instead of going on."""
    old, new = models
    engine = HFEngine(copy.deepcopy(old), TOK.eos_id, TOK.pad_id, version=1, chunk=CHUNK)
    sd = new.state_dict()
    first = next(iter(sd))

    def broken():
        yield first, sd[first]
        yield first, torch.zeros(3, 3)  # wrong shape: check_names refuses it

    def hook() -> None:
        try:  # as the rollout replica's take_sync does: the failure is reported
            engine.load_weights(broken(), 2)
        except ValueError:
            pass

    with pytest.raises(EngineError, match="failed part-way"):
        generate(engine, hook)
    assert engine.version == -1


def test_a_load_that_fails_before_copying_keeps_the_old_version(models):
    old, _ = models
    engine = HFEngine(copy.deepcopy(old), TOK.eos_id, TOK.pad_id, version=1, chunk=CHUNK)

    def bad():
        yield "no.such.weight", torch.zeros(1)

    def hook() -> None:
        with pytest.raises(ValueError, match="weight name"):
            engine.load_weights(bad(), 2)

    comps = generate(engine, hook)
    plain = generate(HFEngine(copy.deepcopy(old), TOK.eos_id, TOK.pad_id, version=1))
    assert engine.version == 1 and all(c.version == 1 and not c.versions for c in comps)
    assert [c.token_ids for c in comps] == [c.token_ids for c in plain]


def test_chunk_must_be_positive(models):
    with pytest.raises(ValueError, match=r"rl\.engine\.chunk"):
        HFEngine(models[0], TOK.eos_id, TOK.pad_id, chunk=0)


def test_versions_reach_the_trainer_through_the_rollout():
    """make_rollouts -> wire payload -> check_payload and completions_of: the rollout's
    version is its oldest token's, and each trainer Completion lists its tokens'."""
    rl = RLConfig.model_validate({"grpo": {"group_size": 2, "max_new_tokens": 12}})
    tok = task_tokenizer(rl.task)
    model = build_model(rl.model, tok)
    engine = HFEngine(copy.deepcopy(model), tok.eos_id, tok.pad_id, version=4, chunk=CHUNK)
    newer = {k: v + 0.01 for k, v in model.state_dict().items()}
    hook, _ = load_after(engine, 1, newer, 5)
    refs = [PromptRef(index=i, rollout_id=f"p{i}.0") for i in range(3)]
    rolls = make_rollouts(rl, engine, tok, task_from_config(rl.task), refs, hook)
    assert all(r.version == 4 for r in rolls)
    spans = [c for r in rolls for c in r.completions if len(c.token_ids) > CHUNK]
    assert spans and all(
        c.versions == [4] * CHUNK + [5] * (len(c.token_ids) - CHUNK) for c in spans
    )
    rows = []
    for i, r in enumerate(rolls):
        payload = RolloutPayload.model_validate(r.payload().model_dump())  # as a store reads it
        summary = BatchRollout(
            rollout_id=r.rollout_id, prompt=i, version=4, reward=0, exact_match=0
        )
        assert check_payload(payload, summary, 2, 12) is None
        rows.append((i, payload))
    comps, _ = completions_of(rows)
    wire = [c for r in rolls for c in r.completions]
    assert [c.versions for c in comps] == [c.versions for c in wire]
    assert all(c.version == 4 for c in comps)
    # A payload whose tokens are older than the ledger's version for it is refused.
    bad = rows[0][1].model_copy(update={"version": 5})
    assert "older than" in (
        check_payload(
            bad, summary.model_copy(update={"rollout_id": bad.rollout_id, "version": 5}), 2, 12
        )
        or ""
    )


def test_inflight_updates_can_be_turned_off_in_the_job_file():
    """``rl.engine.inflight_updates = false``: the replica declares no capability and
    its engine takes no update mid-generation (syncs wait for it to end, as before)."""
    from phalanx.rl.engine.factory import rollout_engine, takes_inflight_updates

    on = RLConfig()
    off = RLConfig.model_validate({"engine": {"inflight_updates": False}})
    assert takes_inflight_updates(on) is True
    assert takes_inflight_updates(off) is False
    tok = task_tokenizer(off.task)
    for rl, want in ((on, True), (off, False)):
        engine = rollout_engine(
            rl, tok, build_model(rl.model, tok, torch.device("cpu")), torch.device("cpu"), "r"
        )
        assert engine.inflight_updates is want
    assert HFEngine.inflight_updates is True  # the class is left as it was

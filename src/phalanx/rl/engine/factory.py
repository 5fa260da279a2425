"""The rollout replicas' engine, as ``[rl.engine]`` names it."""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from phalanx.config.rl import RLConfig
from phalanx.rl.base import Tokenizer
from phalanx.rl.engine.base import EngineError, GenerationEngine
from phalanx.rl.engine.hf import HFEngine


def takes_inflight_updates(rl: RLConfig) -> bool:
    """Whether ``[rl.engine]``'s engine takes weight updates during a generation (its
    class's ``inflight_updates``), known before it is built: a rollout replica
    declares the capability when it registers, before it loads the model. False
    when ``rl.engine.inflight_updates`` turns them off."""
    if not rl.engine.inflight_updates:
        return False
    if rl.engine.kind == "hf":
        return HFEngine.inflight_updates
    from phalanx.rl.engine.vllm import VLLMEngine  # light: vLLM itself is imported lazily

    return VLLMEngine.inflight_updates


def rollout_engine(
    rl: RLConfig, tok: Tokenizer, model: Any, device: torch.device, name: str
) -> GenerationEngine:
    """The engine of a rollout replica named ``name``, holding ``model``'s weights
    (version -1: the caller sets the version it holds).

    ``hf`` samples from ``model`` itself. ``vllm`` serves ``model.path``, or, for a
    model built from config, ``model`` written to a fresh temporary directory that is
    removed once vLLM has loaded it; ``model`` can then be dropped. A model or option vLLM cannot serve, or a vLLM that fails to
    start, is an EngineError saying why in one line.
    """
    engine = _build(rl, tok, model, device, name)
    if not rl.engine.inflight_updates:
        engine.inflight_updates = False  # syncs wait for the generation to end
    return engine


def _build(
    rl: RLConfig, tok: Tokenizer, model: Any, device: torch.device, name: str
) -> GenerationEngine:
    g = rl.grpo
    if rl.engine.kind == "hf" and rl.lora is not None:
        from phalanx.rl.engine.lora import MergedLoraEngine
        from phalanx.rl.lora import apply_lora

        return MergedLoraEngine(
            apply_lora(model, rl.lora, rl.model.seed),
            tok.eos_id,
            tok.pad_id,
            seed=g.seed,
            version=-1,
            chunk=rl.engine.chunk,
            recompute_kv_on_update=rl.engine.recompute_kv_on_update,
        )
    if rl.engine.kind == "hf":
        return HFEngine(
            model,
            tok.eos_id,
            tok.pad_id,
            seed=g.seed,
            version=-1,
            chunk=rl.engine.chunk,
            recompute_kv_on_update=rl.engine.recompute_kv_on_update,
        )
    if importlib.util.find_spec("vllm") is None:  # not imported here: see vllm._prepare_env
        raise EngineError(
            'rl.engine.kind = "vllm" needs vLLM, which is not installed. Install it with '
            'make install (or python scripts/install_vllm.py), or use kind = "hf".'
        )
    if rl.model.path is not None:
        return _vllm(rl, tok, model, device, rl.model.path)
    # A model built from config: written to a directory of its own for vLLM to load,
    # which is removed once the engine holds the weights (or failed to start).
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
    made = Path(tempfile.mkdtemp(prefix=f"phalanx-vllm-{safe}-"))
    try:
        model.save_pretrained(made)
        return _vllm(rl, tok, model, device, made, max_model_len=rl.model.max_positions)
    finally:
        shutil.rmtree(made, ignore_errors=True)


def _vllm(
    rl: RLConfig, tok: Tokenizer, model: Any, device: torch.device, model_dir: Any, **kw: Any
) -> GenerationEngine:
    """A vLLM engine over the model saved in ``model_dir`` (``model``'s weights); with
    ``[rl.lora]``, one that serves the policy's adapter on that base."""
    from phalanx.rl.engine.vllm import VLLMEngine

    opts: dict[str, Any] = {"seed": rl.grpo.seed, "device": device.type, **kw}
    if rl.lora is None:
        return VLLMEngine(model_dir, tok.eos_id, model.state_dict(), rl.engine, **opts)
    from phalanx.rl.engine.vllm_lora import VLLMLoraEngine
    from phalanx.rl.lora import adapter_layout, apply_lora

    # Syncs carry the adapter: its names and shapes are the policy's, which wraps the
    # same model with the same spec (after the base was saved: this wraps ``model``).
    like = adapter_layout(apply_lora(model, rl.lora, rl.model.seed))
    arch = str(getattr(model.config, "model_type", ""))
    return VLLMLoraEngine(model_dir, tok.eos_id, like, rl.lora, arch, rl.engine, **opts)

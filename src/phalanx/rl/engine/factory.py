"""The rollout replicas' engine, as ``[rl.engine]`` names it."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from phalanx.config.rl import RLConfig
from phalanx.rl.base import Tokenizer
from phalanx.rl.engine.base import EngineError, GenerationEngine
from phalanx.rl.engine.hf import HFEngine


def rollout_engine(
    rl: RLConfig, tok: Tokenizer, model: Any, device: torch.device, name: str
) -> GenerationEngine:
    """The engine of a rollout replica named ``name``, holding ``model``'s weights
    (version -1: the caller sets the version it holds).

    ``hf`` samples from ``model`` itself. ``vllm`` serves ``model.path``, or, for a
    model built from config, ``model`` written once to a directory of this replica's
    (replaced when the replica restarts, removed when the engine closes); ``model``
    can then be dropped. A model or option vLLM cannot serve, or a vLLM that fails to
    start, is an EngineError saying why in one line.
    """
    g = rl.grpo
    if rl.engine.kind == "hf":
        return HFEngine(model, tok.eos_id, tok.pad_id, seed=g.seed, version=-1)
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        raise EngineError(
            f'rl.engine.kind = "vllm" needs vLLM: it cannot be imported ({e}). Install it '
            f'with make install (or python scripts/install_vllm.py), or use kind = "hf".'
        ) from e
    from phalanx.rl.engine.vllm import VLLMEngine

    made: Path | None = None
    if rl.model.path is not None:
        model_dir = Path(rl.model.path)
    else:
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        made = model_dir = Path(tempfile.gettempdir()) / f"phalanx-vllm-{safe}"
        shutil.rmtree(made, ignore_errors=True)
        model.save_pretrained(made)
    try:
        engine = VLLMEngine(
            model_dir,
            tok.eos_id,
            model.state_dict(),
            rl.engine,
            seed=g.seed,
            device=device.type,
            max_model_len=rl.model.max_positions if rl.model.path is None else None,
        )
    except EngineError:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
    if made is not None:
        engine.on_close(lambda: shutil.rmtree(made, ignore_errors=True))
    return engine

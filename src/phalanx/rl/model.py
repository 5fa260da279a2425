"""The policy model: a tiny causal LM built with ``transformers`` from config, or a local one.

Nothing is downloaded: :func:`build_model` uses ``AutoModelForCausalLM.from_config``
(random init, deterministic in ``spec.seed``) and a ``spec.path`` is loaded with
``local_files_only=True``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from phalanx.config.rl import ModelSection
from phalanx.rl.base import Tokenizer
from phalanx.rl.tokenizer import check_same_tokenizer

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

_LOAD_LOCK = threading.Lock()


def model_config(spec: ModelSection, tok: Tokenizer) -> PretrainedConfig:
    """The HF config of a model built from ``spec``, sized to the tokenizer's vocabulary."""
    from transformers import GPT2Config, LlamaConfig

    # No dropout anywhere: the importance ratio compares the trainer's forward
    # with the engine's (eval-mode) forward, and dropout would make it != 1 on
    # the very first step after a sync and let the clip eat real gradient.
    if spec.arch == "llama":
        return LlamaConfig(
            vocab_size=tok.vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_heads,
            max_position_embeddings=spec.max_positions,
            tie_word_embeddings=spec.tie_embeddings,
            attention_dropout=0.0,
            pad_token_id=tok.pad_id,
            eos_token_id=tok.eos_id,
            bos_token_id=tok.bos_id,
        )
    return GPT2Config(
        vocab_size=tok.vocab_size,
        n_embd=spec.hidden_size,
        n_layer=spec.num_layers,
        n_head=spec.num_heads,
        n_positions=spec.max_positions,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=spec.tie_embeddings,
        pad_token_id=tok.pad_id,
        eos_token_id=tok.eos_id,
        bos_token_id=tok.bos_id,
    )


def build_model(spec: ModelSection, tok: Tokenizer, device: str | torch.device = "cpu") -> Any:
    """The policy model of ``spec``: loaded from ``spec.path``, else randomly initialised.

    A random init draws from a private RNG seeded with ``spec.seed``: the same
    seed gives bit-identical weights, and the global torch RNG is left untouched.
    Raises ValueError when the model's vocabulary cannot hold the tokenizer's ids.
    """
    from transformers import AutoModelForCausalLM

    model: Any
    if spec.path is not None:
        check_same_tokenizer(tok, spec.path)
        model = load_model(spec.path, spec.attn_implementation)
    else:
        cfg = model_config(spec, tok)
        devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(spec.seed)
            model = AutoModelForCausalLM.from_config(
                cfg, attn_implementation=spec.attn_implementation
            )
    check_vocab(model, tok)
    return model.to(device)


def load_model(path: str | Path, attn_implementation: str = "eager") -> PreTrainedModel:
    """A causal LM from a local directory written by ``save_pretrained`` (Qwen2, Llama,
    GPT-2, or any architecture ``transformers`` has a ``*ForCausalLM`` for). Raises
    ValueError in one line when the directory holds none."""
    from transformers import AutoConfig

    p = Path(path)
    if not p.is_dir():
        raise ValueError(
            f"model.path must be an existing local directory: got {str(p)!r}. Save a model "
            f"there with model.save_pretrained(dir); hub names are not fetched at run time."
        )
    if not (p / "config.json").is_file():
        raise ValueError(f"model.path {str(p)!r} must hold a saved model: it has no config.json.")
    try:
        cfg = AutoConfig.from_pretrained(str(p), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(
            f"model.path {str(p)!r}: its config.json cannot be read: {_first(e)}"
        ) from e
    archs = list(getattr(cfg, "architectures", None) or [])
    if archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise ValueError(
            f"model.path {str(p)!r} must hold a causal LM: its config.json names {archs}. "
            f"Point it at a *ForCausalLM checkpoint."
        )
    from transformers.utils import logging as hf_logging

    # Its progress bar goes to stderr, where a replica's errors must stay one line.
    hf_logging.disable_progress_bar()
    # transformers builds the model on the meta device by patching process-wide
    # state: two threads loading at once (replicas in one process, an engine and a
    # policy) see each other's meta tensors. One load at a time.
    with _LOAD_LOCK:
        return _load(p, attn_implementation)


def _load(p: Path, attn_implementation: str) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    try:
        # fp32 whatever the checkpoint's dtype: these weights are the optimizer's
        # masters (AdamW on bf16 weights loses small updates to rounding);
        # grpo.precision = "bf16" computes in bf16 under autocast.
        return AutoModelForCausalLM.from_pretrained(
            str(p),
            local_files_only=True,
            attn_implementation=attn_implementation,
            dtype=torch.float32,
        )
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise ValueError(f"model.path {str(p)!r} could not be loaded: {_first(e)}") from e


def checkpoint_activations(model: Any, key: str) -> None:
    """Recompute ``model``'s activations in backward (non-reentrant: works with inputs
    that need no grad and with autocast). ``key`` names the option in the one-line
    ValueError raised when the model does not support it."""
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{key} needs a model that supports it: {type(model).__name__} does not. "
            f"Set {key} = false."
        )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def _first(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:200] if text else type(e).__name__


def check_vocab(model: Any, tok: Tokenizer) -> None:
    """Raise when the model's embedding has fewer rows than the tokenizer has ids."""
    rows = model.get_input_embeddings().num_embeddings
    if rows < tok.vocab_size:
        raise ValueError(
            f"model vocabulary must cover the tokenizer's: got {rows} embedding rows, "
            f"expected at least {tok.vocab_size}. Use the tokenizer the model was trained with."
        )


def num_params(model: torch.nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())

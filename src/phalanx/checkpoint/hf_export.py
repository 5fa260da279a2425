"""``phalanx ckpt export --format hf``: a checkpoint's model as a full Hugging Face
directory (``save_pretrained``'s layout, its config, and the job's tokenizer when it
has one), which ``AutoModelForCausalLM.from_pretrained`` loads.

The job file (``--config``) says how to rebuild the model the checkpoint trained:
``[rl.model]`` or ``[train.model]``. A LoRA job's checkpoint holds only the adapter
(``[rl.lora]``, ``[train.lora]``): it is loaded into the base rebuilt from the spec
and merged (W = W0 + (alpha / r) B A, peft's ``merge_and_unload``); the adapter is
also written alone, as a peft adapter directory under ``adapter/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def _model_of(config: str) -> tuple[Any, Any, str | None, int]:
    """(the job's freshly built model, its LoRA section or None, the tokenizer directory
    to copy or None, the model's seed)."""
    from phalanx.config.file import ConfigError
    from phalanx.config.job import load_config
    from phalanx.config.model import ModelSection

    try:
        cfg = load_config(config)
    except ConfigError as e:
        raise ValueError(f"--config {config}: {' '.join(str(e).split())}") from e
    if cfg.rl is not None:
        from phalanx.rl.model import build_model
        from phalanx.rl.tokenizer import task_tokenizer

        rl = cfg.rl
        model = build_model(rl.model, task_tokenizer(rl.task))
        return model, rl.lora, rl.task.tokenizer_path, rl.model.seed
    train = cfg.train
    if train is not None and isinstance(train.model, ModelSection) and train.model.path:
        from phalanx.rl.model import load_model

        model = load_model(train.model.path, train.model.attn_implementation)
        return model, train.lora, train.model.path, train.model.seed
    raise ValueError(
        f"--format hf needs a job whose model is a causal LM: {config} has neither an [rl] "
        f"section nor a [train.model] path. Export it with --format safetensors."
    )


def export_hf(weights: dict[str, torch.Tensor], config: str, out: Path) -> str:
    """Write the model of ``weights`` (a checkpoint's ``model`` subtree, by its state
    names) to the directory ``out``; returns what was done, in a few words. ValueError
    in one line when the weights do not fit the job's model."""
    from phalanx.train.trainable import load_model_state

    model, lora, tokenizer, seed = _model_of(config)
    what = "full model"
    if lora is not None:
        from phalanx.rl.lora import adapter_state, apply_lora, write_adapter

        model = apply_lora(model, lora, seed, key="lora")
        load_model_state(model, weights, trainable_only=True)
        arch = str(getattr(model.config, "model_type", ""))
        write_adapter(out / "adapter", adapter_state(model), lora, arch)
        model = model.merge_and_unload()
        what = f"base + LoRA adapter (r={lora.r}) merged"
    else:
        try:
            model.load_state_dict(weights)
        except RuntimeError as e:
            raise ValueError(
                f"the checkpoint's weights do not fit the model of {config}: "
                f"{str(e).splitlines()[0][:200]}"
            ) from e
    model.save_pretrained(out)
    if tokenizer is not None and any(Path(tokenizer).glob("tokenizer*")):
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer, local_files_only=True).save_pretrained(out)
    return what

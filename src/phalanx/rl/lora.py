"""LoRA on a causal LM with ``peft``: the adapter a policy trains and syncs.

- :func:`apply_lora` wraps a freshly built model with ``peft.get_peft_model``
  (base frozen), after checking that ``target_modules`` match some linear
  module of it; the adapter's random init (A; B starts at zero) is drawn from
  a private RNG seeded with the model's seed, so every replica starts alike.
- :func:`adapter_state` is the adapter as a weight sync carries it: peft's
  saved names (``...q_proj.lora_A.weight``, the layout of
  ``adapter_model.safetensors``), nothing of the base.
- :class:`MergedAdapter` applies such tensors to a model built alike as
  merged weights, W = W0 + (alpha / r) B A, from a kept copy of each W0, so
  versions never accumulate rounding (the HF engine's way to serve an adapter).
- :func:`write_adapter` writes a peft adapter directory (safetensors and
  ``adapter_config.json``) for an engine that loads adapters from disk (vLLM).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from phalanx.config.model import LoraSection

LINEAR = ("Linear", "Conv1D")
"""Module classes LoRA wraps here (``torch.nn.Linear``; ``Conv1D``: gpt2's)."""


def linear_names(model: torch.nn.Module) -> list[str]:
    """The last name part of each linear module of ``model``, each once, in order."""
    seen: dict[str, None] = {}
    for name, mod in model.named_modules():
        if name and type(mod).__name__ in LINEAR:
            seen.setdefault(name.rsplit(".", 1)[-1], None)
    return list(seen)


def check_targets(model: torch.nn.Module, spec: LoraSection, key: str) -> None:
    """ValueError in one line when no module of ``model`` is a linear module named by
    ``spec.target_modules`` (peft's rule: the name, or a suffix after a dot)."""
    targets = spec.target_modules
    hit = [
        name
        for name, mod in model.named_modules()
        if type(mod).__name__ in LINEAR
        and any(name == t or name.endswith("." + t) for t in targets)
    ]
    if not hit:
        arch = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ValueError(
            f"{key}.target_modules {json.dumps(targets)} match no module of the model "
            f"({arch}): its linear modules are {', '.join(linear_names(model))}. Name some "
            f"of them."
        )


def apply_lora(model: Any, spec: LoraSection, seed: int, key: str = "rl.lora") -> Any:
    """``model`` wrapped with LoRA adapters (a ``peft.PeftModel``), its base frozen.
    The adapters' init is drawn from a private RNG seeded with ``seed``: the same seed
    gives the same adapter, and the global torch RNG is left untouched."""
    from peft import LoraConfig, get_peft_model

    check_targets(model, spec, key)
    conv1d = any(type(m).__name__ == "Conv1D" for m in model.modules())
    cfg = LoraConfig(
        r=spec.r,
        lora_alpha=spec.alpha,
        lora_dropout=spec.dropout,
        target_modules=list(spec.target_modules),
        fan_in_fan_out=conv1d,  # gpt2's Conv1D stores its weight transposed
        bias="none",
    )
    device = next(model.parameters()).device
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        return get_peft_model(model, cfg)


def is_lora(model: Any) -> bool:
    """Whether ``model`` is a peft model (its state is an adapter's)."""
    return hasattr(model, "peft_config")


def adapter_state(model: Any) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a peft ``model``, by peft's saved names (no copies)."""
    from peft import get_peft_model_state_dict

    return dict(get_peft_model_state_dict(model))


def adapter_layout(model: Any) -> dict[str, torch.Tensor]:
    """Meta tensors shaped like :func:`adapter_state`'s: what a sync is checked against."""
    return {
        k: torch.empty(v.shape, dtype=v.dtype, device="meta")
        for k, v in adapter_state(model).items()
    }


def nbytes(tensors: Mapping[str, torch.Tensor]) -> int:
    """The bytes of ``tensors``' elements."""
    return sum(t.numel() * t.element_size() for t in tensors.values())


class MergedAdapter:
    """Serves adapter versions as merged weights in a peft ``model`` built with the
    policy's spec (the same base and LoRA config): each :meth:`load` restores every
    wrapped layer's base weight W0 from a kept copy, copies the adapter in, and merges
    it (peft's ``merge``), so the forward is the plain base model's, at its cost."""

    def __init__(self, model: Any):
        from peft.tuners.lora import LoraLayer

        self.model = model.eval().requires_grad_(False)
        self.layers: list[Any] = [m for m in model.modules() if isinstance(m, LoraLayer)]
        self.base = [m.get_base_layer().weight.detach().clone() for m in self.layers]
        self.like = adapter_layout(model)

    def check(self, adapter: Mapping[str, torch.Tensor]) -> None:
        """ValueError unless ``adapter`` holds exactly the tensors of :attr:`like`."""
        from phalanx.rl.engine.base import check_names

        check_names(self.like, adapter.items())
        missing = sorted(set(self.like) - set(adapter))
        if missing:
            raise ValueError(
                f"an adapter update must hold every adapter tensor: missing {missing[:3]}. "
                f"The sender's [rl.lora] must be this replica's."
            )

    @torch.no_grad()
    def load(self, adapter: Mapping[str, torch.Tensor]) -> None:
        """Merge ``adapter``, checked first (:meth:`check`); a failure after that leaves the
        model's weights mixed (the caller's version says so)."""
        from peft import set_peft_model_state_dict

        self.check(adapter)
        for layer, w0 in zip(self.layers, self.base, strict=True):
            layer.get_base_layer().weight.copy_(w0)
            layer.merged_adapters.clear()
        set_peft_model_state_dict(self.model, dict(adapter))
        for layer in self.layers:
            layer.merge()


def write_adapter(
    directory: str | Path, adapter: Mapping[str, torch.Tensor], spec: LoraSection, arch: str
) -> Path:
    """A peft adapter directory in ``directory``: ``adapter_model.safetensors`` (the
    tensors of :func:`adapter_state`) and ``adapter_config.json``; returns its path."""
    from safetensors.torch import save_file

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in adapter.items()}
    save_file(tensors, str(d / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": spec.r,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": list(spec.target_modules),
        "fan_in_fan_out": arch == "gpt2",
        "bias": "none",
        "base_model_name_or_path": None,
        "modules_to_save": None,
    }
    (d / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return d


def merged_state(model: Any) -> dict[str, torch.Tensor]:
    """The plain model's ``state_dict`` (HF names) of a peft ``model`` whose adapter is
    merged (:class:`MergedAdapter`): each wrapped layer's base weight under its own name,
    no adapter tensor."""
    out = {}
    for k, v in model.get_base_model().state_dict().items():
        if ".lora_" not in k:
            out[k.replace(".base_layer.", ".")] = v
    return out


def policy_model(rl: Any, tok: Any, device: Any) -> Any:
    """The policy of ``rl`` (an RLConfig), ready to train: built from ``rl.model``, with
    ``rl.grpo``'s options, wrapped with LoRA when ``[rl.lora]`` is set."""
    from phalanx.rl.model import build_model
    from phalanx.rl.step import prepare

    model = prepare(build_model(rl.model, tok, device).train(), rl.grpo)
    return apply_lora(model, rl.lora, rl.model.seed) if rl.lora is not None else model

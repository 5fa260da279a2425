"""The HF engine serving a LoRA policy: syncs carry the adapter, the engine merges it.

A weight sync of a ``[rl.lora]`` job carries only the adapter's tensors
(:func:`phalanx.rl.lora.adapter_state`): :meth:`MergedLoraEngine.layout` is
their layout, which the weight channel checks a sync against, and
:meth:`MergedLoraEngine.load_weights` merges them into the engine's base model
(W = W0 + (alpha / r) B A, from a kept W0), so generation runs at the plain
model's cost. All-or-nothing as :class:`~phalanx.rl.engine.hf.HFEngine`: names and
shapes are checked before anything is written, and once the first weight is
written the engine holds version -1 until the last is.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from phalanx.rl.engine.base import Weights
from phalanx.rl.engine.hf import HFEngine
from phalanx.rl.lora import MergedAdapter


class MergedLoraEngine(HFEngine):
    """:class:`HFEngine` over a peft ``model`` (the policy's base and LoRA config),
    taking adapter versions."""

    def __init__(self, model: Any, eos_id: int, pad_id: int, **kwargs: Any):
        self.adapter = MergedAdapter(model)
        # The wrapped layers act as their merged base: generate with the plain model.
        super().__init__(model.get_base_model(), eos_id, pad_id, **kwargs)

    def layout(self) -> Mapping[str, torch.Tensor]:
        return self.adapter.like

    def load_weights(self, weights: Weights, version: int) -> None:
        """Merge the adapter ``weights`` (all of its tensors, as a mapping or a stream)."""
        adapter = dict(weights.items() if isinstance(weights, Mapping) else weights)
        self.adapter.check(adapter)  # before anything is written: the old version stays
        self.version = -1
        self.adapter.load(adapter)
        self.version = int(version)

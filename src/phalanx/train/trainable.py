"""The trainable part of a model's state, for a model whose frozen part every
replica rebuilds by itself (a LoRA base: the same seed or the same directory).

The FT manager carries only this part in a heal and a checkpoint when it is
built with ``trainable_only`` (``[rl.lora]``, ``[train.lora]``): the bytes a
joiner receives and a save writes are the adapter's and its optimizer state's,
not the model's.
"""

from __future__ import annotations

from typing import Any

import torch


def trainable_state(model: torch.nn.Module) -> dict[str, Any]:
    """The ``state_dict`` entries of ``model``'s parameters that require grad (the
    tensors themselves, not copies: a heal sends them and a load fills them)."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in model.state_dict().items() if k in names}


def load_trainable(model: torch.nn.Module, sd: dict[str, Any]) -> None:
    """Copy ``sd`` (a :func:`trainable_state` of a model built alike) into ``model``;
    ValueError in one line when its names are not exactly the trainable ones."""
    own = trainable_state(model)
    if set(own) != set(sd):
        extra, missing = sorted(set(sd) - set(own)), sorted(set(own) - set(sd))
        raise ValueError(
            f"the state's trainable tensors must be this model's: got {len(extra)} unknown "
            f"{extra[:3]} and {len(missing)} missing {missing[:3]}. Every replica must have "
            f"the same model and [lora] config."
        )
    with torch.no_grad():
        for k, v in own.items():
            v.copy_(sd[k])


def model_state(model: torch.nn.Module, trainable_only: bool) -> dict[str, Any]:
    """What a heal and a checkpoint carry of ``model``: its whole ``state_dict``, or
    with ``trainable_only`` its :func:`trainable_state`."""
    return trainable_state(model) if trainable_only else model.state_dict()


def load_model_state(model: torch.nn.Module, sd: dict[str, Any], trainable_only: bool) -> None:
    """Load a :func:`model_state` of the same ``trainable_only`` into ``model``."""
    if trainable_only:
        load_trainable(model, sd)
    else:
        model.load_state_dict(sd)

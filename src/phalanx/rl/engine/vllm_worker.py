"""Code that runs inside vLLM's worker: ``LLM(worker_extension_cls=...)`` mixes
:class:`WorkerExtension` into the worker, and ``llm.collective_rpc(name, args)``
calls its methods there.

:class:`~phalanx.rl.engine.vllm.VLLMEngine` runs vLLM in its own process (one
worker, no engine-core subprocess), so the arguments of a call are the
caller's objects: the tensors of a weight update are copied from the
receiver's buffers into vLLM's parameters, never serialized. With several
workers (``tensor_parallel_size > 1``, vLLM's ``mp`` executor) each worker is a
process of its own and reads the update from a shared staging buffer
(``vllm_staging.py``): only the buffer's JSON spec travels in the RPC.

Kept apart from ``vllm.py`` and free of vLLM imports at module level: vLLM
imports this module by name inside the worker.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from phalanx.rl.engine.base import one_line
from phalanx.rl.engine.vllm_staging import StagingSpec, read_stream


class WorkerExtension:
    """Methods added to vLLM's worker (``self`` is the worker: ``self.model_runner``)."""

    model_runner: Any
    rank: int
    _phalanx_fault: tuple[int, int] | None = None

    def phalanx_reload(self, source: str | Iterable[tuple[str, torch.Tensor]]) -> str:
        """Reload weights in place; "" when done, else why it failed (one line).

        ``source``: ``(hf_name, full tensor)`` pairs (the engine's own process), or
        the JSON :class:`~phalanx.rl.engine.vllm_staging.StagingSpec` of a staging
        buffer that the engine fills while this runs (a worker process of its own).
        Called on every worker at once (``collective_rpc``); each takes its shard.

        ``reload_weights`` runs the model's own ``load_weights`` (which maps HF
        names to vLLM's fused parameters and slices this rank's shard) and then the
        post-load processing the CPU backend needs (a plain ``load_weights`` skips
        it and leaves repacked weights stale). It consumes the pairs as they come,
        so a layer is reloaded while the next tensors are still arriving. A failure
        is returned, not raised, so the engine learns every worker's outcome and
        can reload them all from its rollback copy (all-or-nothing)."""
        pairs = read_stream(StagingSpec.from_json(source)) if isinstance(source, str) else source
        try:
            self.model_runner.reload_weights(weights_iterator=self._phalanx_faulty(iter(pairs)))
        except Exception as e:
            self._phalanx_abort_reload()
            return f"rank {getattr(self, 'rank', 0)}: {one_line(e)}"
        return ""

    def phalanx_fail_reload(self, rank: int, after: int) -> None:
        """A declared fault (tests): the next reload on worker ``rank`` fails after
        ``after`` tensors, as a worker whose copy breaks part-way would."""
        self._phalanx_fault = (rank, after) if getattr(self, "rank", 0) == rank else None

    def _phalanx_faulty(
        self, pairs: Iterator[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        fault, self._phalanx_fault = self._phalanx_fault, None
        for i, pair in enumerate(pairs):
            if fault is not None and i == fault[1]:
                raise RuntimeError(f"declared fault: worker {fault[0]} fails after {i} tensors")
            yield pair

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
        """A float digest of this worker's parameters, its tensor-parallel shard (tests:
        equal weights, equal digests)."""
        model = self.model_runner.get_model()
        total = torch.zeros((), dtype=torch.float64)
        for i, p in enumerate(model.parameters()):
            total += (i + 1) * p.detach().double().sum()
        return float(total)

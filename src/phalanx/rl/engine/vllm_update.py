"""A versioned in-place weight update of every vLLM worker: overlapped, all-or-nothing.

Order of one update (:meth:`WeightUpdater.apply`)
------------------------------------------------
1. Every worker starts ``phalanx_reload`` at once (``collective_rpc``): vLLM's
   layer-wise reload, fed by an iterator that yields each tensor as soon as it
   is in the engine's staging buffer (``vllm_staging.py``).
2. Meanwhile the engine takes the update's pairs one at a time from the weight
   channel (whose receiver thread is still bringing the next bytes), checks
   each name and shape, and copies it into the staging buffer. So tensor k is
   reloaded while tensor k + 1 arrives: the reload is no longer a second pass
   after the whole transfer. With one worker (``uni``) the reload runs in this
   thread and the overlap is with the channel's receiver thread; with T workers
   they are T processes that reload while this thread receives.
3. When every worker returned "" and the stream ended cleanly, the staging
   buffer becomes the held copy (the next update's rollback copy).
4. Otherwise (a bad pair, the channel failed part-way, any worker failed) every
   worker reloads the held copy, so all of them are back at the previous
   version's weights, whole (a layer-wise reload cannot be undone by copying
   parameters back: the CPU backend's packed kernels are rebuilt from them).
   The caller keeps its old version. Only when there is no held copy (the
   engine was built from a layout without values), or the rollback itself
   failed, is the engine left with no usable version.

Costs: two host copies of the weights (held and staging, in ``/dev/shm`` when
T > 1), and one host memcpy of each tensor per update, done while the next
bytes arrive (on CPU about a third of a 440 MB update: docs/benchmarks.md).
With one worker and an :class:`~phalanx.rl.engine.base.Owned` stream (a weight
channel's fresh receive buffer, which nobody writes again) there is no copy:
the received tensors go straight into vLLM's loaders and, once the update is
whole, are kept as they are as the held copy (a dict of them, where the
staging buffer would have been).
Without a rollback copy (``rl.engine.rollback_copy = false``) there is no held
copy, and with one worker no staging either: each tensor goes straight into
vLLM's loaders. A failure part-way then leaves the engine with no usable
version (UpdateFailed with ``restored`` False).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from phalanx.rl.engine.base import Owned, check_names, one_line
from phalanx.rl.engine.vllm_staging import ABORTED, DONE, Staging

STALL_S = 600.0


class UpdateFailed(Exception):
    """An update did not land; ``restored``: every worker is back at the held version."""

    def __init__(self, message: str, restored: bool, cause: BaseException | None):
        super().__init__(message)
        self.restored = restored
        self.cause = cause


class WeightUpdater:
    """Moves weight updates into the workers of ``llm`` (``tp`` of them)."""

    def __init__(
        self,
        llm: Any,
        like: Mapping[str, torch.Tensor],
        tp: int,
        rollback: bool = True,
    ):
        self.llm = llm
        self.tp = tp
        self.rollback = rollback
        layout = {k: (tuple(t.shape), t.dtype) for k, t in like.items()}
        self.meta = {k: torch.empty(s, dtype=d, device="meta") for k, (s, d) in layout.items()}
        shared = tp > 1
        self.held: Staging | dict[str, torch.Tensor] | None = None
        """The version the workers hold; None: no values to roll back to (none kept, or
        the engine was built from a layout without values and no update landed whole)."""
        self.stage = Staging(layout, shared, STALL_S) if shared or rollback else None
        """Where an update's tensors go on their way in; None: straight into vLLM."""
        if rollback and not any(t.is_meta for t in like.values()):
            first = Staging(layout, shared, STALL_S)
            for k, t in like.items():
                first.views[k].copy_(t.detach())
            self.held = first
        self._rpc = ThreadPoolExecutor(1, thread_name_prefix="phalanx-vllm-rpc") if shared else None

    def apply(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load ``pairs`` into every worker, or none: UpdateFailed says which."""
        failure: list[BaseException] = []
        seen: set[str] = set()
        kept: dict[str, torch.Tensor] | None = None
        stage = self.stage
        if self._rpc is None and self.rollback and isinstance(pairs, Owned):
            kept, stage = {}, None  # kept as received: no staging copy (module doc)
        if stage is not None:
            stage.begin()

        def feed() -> Iterator[tuple[str, torch.Tensor]]:
            try:
                for name, tensor in pairs:
                    check_names(self.meta, [(name, tensor)])
                    seen.add(name)
                    if kept is not None:
                        kept[name] = tensor
                    yield name, tensor if stage is None else stage.put(name, tensor)
            except BaseException as e:
                failure.append(e)
                raise

        if self._rpc is None or stage is None:  # one worker (T > 1 always stages)
            errors = self.llm.collective_rpc("phalanx_reload", args=(feed(),))
        else:
            future = self._rpc.submit(
                self.llm.collective_rpc, "phalanx_reload", args=(stage.spec.to_json(),)
            )
            try:
                for _ in feed():
                    pass
                stage.end(DONE)
            except BaseException:
                stage.end(ABORTED)
            errors = future.result()
        errors = [e for e in errors if e]
        if not failure and not errors:
            if kept is not None:
                self._keep(kept)
            else:
                self._commit(seen)
            return
        cause = failure[0] if failure else None
        why = one_line(cause) if cause is not None else "; ".join(errors)
        raise UpdateFailed(why, self._restore(), cause)

    def _commit(self, seen: set[str]) -> None:
        if not self.rollback or self.stage is None:
            return  # nothing kept: the staging buffer (T > 1) is refilled next time
        held = self.held
        if held is not None and len(seen) < len(self.stage.names):
            for k in seen:  # a partial stream: the held copy takes what changed
                _slot(held, k).copy_(self.stage.views[k])
        elif held is None and len(seen) < len(self.stage.names):
            return  # still no whole copy to roll back to
        else:
            spare = held if isinstance(held, Staging) else _fresh(self.stage)
            self.held, self.stage = self.stage, spare

    def _keep(self, kept: dict[str, torch.Tensor]) -> None:
        """An :class:`Owned` update landed (one worker): its tensors, as received,
        become the held copy, or update it where the stream was partial."""
        held = self.held
        if len(kept) == len(self.meta):
            self.held = kept
        elif isinstance(held, dict):
            held.update(kept)
        elif held is not None:
            for k, t in kept.items():
                held.views[k].copy_(t)

    def _restore(self) -> bool:
        """Reload every worker from the held copy; whether all of them took it."""
        if self.held is None:
            return False
        try:
            if self._rpc is None:
                errors = self.llm.collective_rpc("phalanx_reload", args=(self.held.items(),))
            else:
                assert isinstance(self.held, Staging)  # (T > 1: always staged, never Owned)
                self.held.publish_all()
                errors = self.llm.collective_rpc("phalanx_reload", args=(self.held.spec.to_json(),))
        except Exception:
            return False
        return not any(errors)

    def close(self) -> None:
        if self._rpc is not None:
            self._rpc.shutdown(wait=False, cancel_futures=True)
        for s in (self.held, self.stage):
            if isinstance(s, Staging):
                s.close()


def _slot(held: Staging | dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return held.views[name] if isinstance(held, Staging) else held[name]


def _fresh(like: Staging) -> Staging:
    layout = {k: (tuple(v.shape), v.dtype) for k, v in like.views.items()}
    return Staging(layout, bool(like.paths), STALL_S)

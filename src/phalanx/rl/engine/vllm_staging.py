"""The host buffers a weight update goes through on its way into vLLM's workers.

Why they exist
--------------
A vLLM engine of ``tensor_parallel_size = T > 1`` runs its T workers in
processes of their own (vLLM's ``mp`` executor), and ``collective_rpc`` pickles
its arguments, so the tensors of an update cannot travel as arguments. They go
through a :class:`Staging` buffer instead: a file mapped by the engine and by
every worker (``torch.from_file(shared=True)``, in ``/dev/shm`` where there is
one), and only its :class:`StagingSpec` (JSON: paths and layout) travels in the
RPC. Each worker takes its own tensor-parallel shard from the full tensors
(vLLM's ``load_weights`` of the model does the slicing).

Wire format of one buffer
-------------------------
- ``<name>.data``: every tensor of the layout, sorted by name, contiguous, each
  at the offset the spec gives (the layout of ``transport/collective.py``'s
  ``pack``);
- ``<name>.ctl``: int64 ``[state, count, order[0], ..., order[N-1]]``. The engine
  writes a tensor's bytes, then its index at ``order[count]``, then ``count + 1``;
  ``state`` goes from ``STREAMING`` to ``DONE`` after the last tensor, or to
  ``ABORTED`` when the update failed on the engine's side. A worker reads the
  tensors in ``order`` as ``count`` passes them, so it reloads tensor k while
  the engine still receives tensor k + 1 (the overlap). It reads ``state``
  before ``count``, so that under ``DONE`` the count it reads is final.

The engine keeps two buffers: the version it holds (the rollback copy: a
failed update is undone by reloading every worker from it) and the one being
filled. An engine with one worker (``uni``) uses the same buffers in its own
memory and hands the worker an iterator instead of a spec.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

STREAMING, DONE, ABORTED = 0, 1, 2

DTYPES = {str(d): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


@dataclass(frozen=True)
class StagingSpec:
    """What a worker needs to read a :class:`Staging` buffer: the one message of an update."""

    data: str
    ctl: str
    names: list[str]
    shapes: list[list[int]]
    dtypes: list[str]
    offsets: list[int]
    stall_s: float
    """A worker gives up when no tensor came for this long (the engine died mid-update)."""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def from_json(text: str) -> StagingSpec:
        return StagingSpec(**json.loads(text))


def _dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _mapped(path: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_file(path, shared=True, size=numel, dtype=dtype)


class Staging:
    """One full copy of the weights, by HF name, laid out for every worker to map.

    ``shared``: in files every process can map (T > 1), else in this process's memory.
    """

    def __init__(
        self, like: Mapping[str, tuple[tuple[int, ...], torch.dtype]], shared: bool, stall_s: float
    ):
        self.names = sorted(like)
        self.index = {k: i for i, k in enumerate(self.names)}
        sizes = [torch.Size(like[k][0]).numel() * like[k][1].itemsize for k in self.names]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        nbytes = sum(sizes)
        self.paths: list[Path] = []
        if shared:
            base = _dir() / f"phalanx-staging-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            data, ctl = Path(f"{base}.data"), Path(f"{base}.ctl")
            for p, n in ((data, nbytes), (ctl, 8 * (2 + len(self.names)))):
                with open(p, "wb") as f:
                    f.truncate(max(n, 1))
                self.paths.append(p)
            self.flat = _mapped(str(data), max(nbytes, 1), torch.uint8)
            self.ctl = _mapped(str(ctl), 2 + len(self.names), torch.int64)
        else:
            self.flat = torch.empty(max(nbytes, 1), dtype=torch.uint8)
            self.ctl = torch.zeros(2 + len(self.names), dtype=torch.int64)
        self.views = {
            k: self.flat[o : o + n].view(like[k][1]).view(like[k][0])
            for k, o, n in zip(self.names, self.offsets, sizes, strict=True)
        }
        self.spec = StagingSpec(
            data=str(self.paths[0]) if shared else "",
            ctl=str(self.paths[1]) if shared else "",
            names=self.names,
            shapes=[list(like[k][0]) for k in self.names],
            dtypes=[str(like[k][1]) for k in self.names],
            offsets=self.offsets,
            stall_s=stall_s,
        )

    def begin(self) -> None:
        self.ctl[1] = 0
        self.ctl[0] = STREAMING

    def put(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Copy ``tensor`` into its slot and publish it to the workers; the slot."""
        view = self.views[name]
        view.copy_(tensor.detach())
        n = int(self.ctl[1])
        self.ctl[2 + n] = self.index[name]
        self.ctl[1] = n + 1
        return view

    def end(self, state: int) -> None:
        self.ctl[0] = state

    def publish_all(self) -> None:
        """Every tensor, in layout order, as one finished update (a rollback reads this)."""
        self.ctl[2 : 2 + len(self.names)] = torch.arange(len(self.names))
        self.ctl[1] = len(self.names)
        self.ctl[0] = DONE

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.views.items())

    def close(self) -> None:
        for p in self.paths:
            p.unlink(missing_ok=True)
        self.paths = []


def read_stream(spec: StagingSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """A worker's side of a buffer: its tensors as the engine publishes them, in the
    engine's order, until ``DONE``. RuntimeError when the engine aborted the update
    or published nothing for ``stall_s``."""
    nbytes = spec.offsets[-1] + _nbytes(spec, -1) if spec.names else 1
    flat = _mapped(spec.data, max(nbytes, 1), torch.uint8)
    ctl = _mapped(spec.ctl, 2 + len(spec.names), torch.int64)
    done, last = 0, time.monotonic()
    while True:
        state = int(ctl[0])
        count = int(ctl[1])
        while done < count:
            i = int(ctl[2 + done])
            o, n = spec.offsets[i], _nbytes(spec, i)
            dtype = DTYPES[spec.dtypes[i]]
            yield spec.names[i], flat[o : o + n].view(dtype).view(spec.shapes[i])
            done, last = done + 1, time.monotonic()
        if state == DONE:
            return
        if state == ABORTED:
            raise RuntimeError("the engine abandoned this weight update part-way")
        if time.monotonic() - last > spec.stall_s:
            raise RuntimeError(
                f"no tensor of this weight update came for {spec.stall_s:.0f} s: the engine "
                f"stopped sending"
            )
        time.sleep(0.0002)  # the engine is receiving the next tensor


def _nbytes(spec: StagingSpec, i: int) -> int:
    return torch.Size(spec.shapes[i]).numel() * DTYPES[spec.dtypes[i]].itemsize

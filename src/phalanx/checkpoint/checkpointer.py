"""Save and load universal checkpoints of a replica's state tree.

The state is any tree of dicts, lists and tuples whose leaves are tensors
(plain or DTensor), JSON scalars or numpy arrays. Tensors go through
torch.distributed.checkpoint, keyed by their path in the tree, so a
checkpoint saved by one layout (data-parallel replicas x tensor-parallel
ranks) loads into any other: DCP records global shapes and chunk offsets, and
each loading rank reads the byte ranges of its own shards. Everything else
(step, data cursor, RNG, param_groups, config) is JSON in the manifest.

Save: ``save`` blocks; ``save_async`` copies the tensors to host memory (the
only stall) and persists them on a background thread. Commit: every rank
writes its data, the coordinator writes ``.metadata`` then the manifest
(``phalanx.json``), then moves ``latest``. A killed save leaves the previous
checkpoint as it was.

Load: the newest committed checkpoint is checked before anything is read
into the caller's tensors (manifest, every file's size and every chunk's
CRC32, and that its tensors fit the template). If it fails, the loader says
why in one line and falls back to the previous one.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
import warnings
import zlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.tensor import DTensor

from phalanx.checkpoint.base import (
    METADATA,
    CheckpointError,
    IncompatibleCheckpoint,
    LoadResult,
    Manifest,
    NoUsableCheckpoint,
    TensorInfo,
)
from phalanx.checkpoint.dcp_io import JsonStorageReader, JsonStorageWriter, dtype_name, dtype_of
from phalanx.checkpoint.store import CheckpointStore
from phalanx.comm.transfer import flatten, unflatten

log = logging.getLogger("phalanx.checkpoint")

REASON_BYTES = 512


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """DCP warns on every single-process save or load that it assumes one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=".*assuming the intent is to", category=UserWarning
        )
        yield


def snapshot(
    tensors: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Copies of ``tensors`` in host memory (DTensors stay DTensors), made into
    ``buffers`` (allocated at the first save and reused: a fresh allocation's
    page faults cost more than the copy)."""
    out: dict[str, torch.Tensor] = {}
    for k, t in tensors.items():
        local = t.to_local() if isinstance(t, DTensor) else t
        buf = buffers.get(k)
        if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
            buf = buffers[k] = torch.empty(local.shape, dtype=local.dtype, device="cpu")
        buf.copy_(local.detach())
        if isinstance(t, DTensor):
            out[k] = DTensor.from_local(
                buf, t.device_mesh, t.placements, shape=t.shape, stride=t.stride(), run_check=False
            )
        else:
            out[k] = buf
    for k in set(buffers) - set(tensors):
        del buffers[k]
    return out


class Checkpointer:
    """Universal checkpoints of one replica's state under ``url``.

    Who calls: every rank of ``group`` (the ranks that together hold one copy
    of the state, e.g. one replica's tensor-parallel ranks), with the same
    arguments; ``save``, ``save_async`` and ``load`` are collectives over it.
    With ``group=None`` and torch.distributed initialised, a dedicated gloo
    group over the default world is made here (a collective too), so that a
    background save never interleaves with training's collectives. Without
    torch.distributed, it is a single-process checkpointer.

    Failure: a failed save raises from ``save`` (or from the next ``wait``) and
    leaves earlier checkpoints whole; ``load`` raises CheckpointError only
    when no committed checkpoint is usable."""

    def __init__(
        self,
        url: str,
        *,
        keep_last: int = 3,
        group: Any = None,
        storage_options: dict[str, Any] | None = None,
        layout: dict[str, Any] | None = None,
        on_commit: Any = None,
    ):
        if keep_last < 1:
            raise ValueError(f"keep_last must be >= 1: got {keep_last}.")
        self.store = CheckpointStore(url, storage_options)
        self.keep_last = keep_last
        self.layout = dict(layout or {})
        """The saving layout, recorded in each manifest (free-form JSON). A caller may
        change it between saves; each save records the value it had when it began."""
        self.on_commit = on_commit
        self.distributed = dist.is_available() and dist.is_initialized()
        if self.distributed and group is None:
            group = dist.new_group(backend="gloo")
        self.group = group
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.world = dist.get_world_size(group) if self.distributed else 1
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="phalanx-ckpt")
        self._inflight: Future[Manifest | None] | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self.last_stall_s = 0.0
        self.last_save_s = 0.0

    @property
    def coordinator(self) -> bool:
        return self.rank == 0

    # -- save ------------------------------------------------------------

    def save(self, step: int, state: Any, extra: dict[str, Any] | None = None) -> Manifest | None:
        """Save ``state`` as step ``step`` and wait until it is committed.
        Returns the manifest on the coordinator (None elsewhere)."""
        self.wait()
        skeleton, tensors = flatten(state, keyed=True)
        return self._persist(step, skeleton, tensors, extra or {}, dict(self.layout))

    def save_async(
        self, step: int, state: Any, extra: dict[str, Any] | None = None
    ) -> Future[Manifest | None]:
        """Copy ``state``'s tensors to host memory, then persist them in the
        background; training may change ``state`` as soon as this returns. A
        save still in flight is waited for first (one at a time)."""
        self.wait()
        t0 = time.perf_counter()
        skeleton, tensors = flatten(state, keyed=True)
        snap = snapshot(tensors, self._buffers)
        self.last_stall_s = time.perf_counter() - t0
        self._inflight = self._pool.submit(
            self._persist, step, skeleton, snap, extra or {}, dict(self.layout)
        )
        return self._inflight

    @property
    def busy(self) -> bool:
        """A save is in flight and not finished (``wait`` would block)."""
        return self._inflight is not None and not self._inflight.done()

    def wait(self) -> Manifest | None:
        """Wait for the save in flight, if any; raises what it raised."""
        fut, self._inflight = self._inflight, None
        return fut.result() if fut is not None else None

    def _persist(
        self,
        step: int,
        skeleton: Any,
        tensors: dict[str, torch.Tensor],
        extra: dict[str, Any],
        layout: dict[str, Any],
    ) -> Manifest | None:
        t0 = time.perf_counter()
        save_id = self._agree_id()
        staging = self.store.staging_path(step, save_id)
        self.store.fs.makedirs(staging, exist_ok=True)
        writer = JsonStorageWriter(self.store.fs, staging)
        with quiet():
            dcp.save(
                tensors,
                storage_writer=writer,
                planner=DefaultSavePlanner(),
                process_group=self.group,
                no_dist=not self.distributed,
            )
        manifest = None
        ok = 1
        if self.coordinator:
            try:
                manifest = self._manifest(step, save_id, skeleton, writer, staging, extra, layout)
                self.store.commit(staging, manifest)
            except Exception:
                ok = 0
                raise
            finally:
                ok = self._all_ok(ok)
            self.store.retain(self.keep_last)
            self.last_save_s = time.perf_counter() - t0
            log.info(
                "checkpoint step %d committed: %s (%.1f MB in %.2f s)",
                step,
                self.store.url_of(step),
                manifest.nbytes / 1e6,
                self.last_save_s,
            )
            if self.on_commit is not None:
                self.on_commit(step, self.store.url_of(step), manifest)
        elif not self._all_ok(1):
            raise CheckpointError(f"checkpoint step {step}: the coordinator failed to commit it")
        return manifest

    def _manifest(
        self,
        step: int,
        save_id: str,
        skeleton: Any,
        writer: JsonStorageWriter,
        staging: str,
        extra: dict[str, Any],
        layout: dict[str, Any],
    ) -> Manifest:
        md = self.store.fs.cat_file(f"{staging}/{METADATA}")
        chunks = dict(writer.chunks)
        chunks[METADATA] = [
            {"key": METADATA, "offset": 0, "length": len(md), "crc32": zlib.crc32(md)}
        ]
        files = {name: sum(c["length"] for c in cs) for name, cs in chunks.items()}
        return Manifest(
            step=step,
            save_id=save_id,
            created_at=time.time(),
            world_size=self.world,
            layout=layout,
            files=files,
            chunks=chunks,
            tensors={
                k: TensorInfo(tuple(m.size), dtype_name(m.properties.dtype))
                for k, m in writer.tensors.items()
            },
            skeleton=skeleton,
            extra=extra,
        )

    # -- load ------------------------------------------------------------

    def load(self, template: Any = None, step: int | None = None) -> LoadResult | None:
        """Load the newest usable committed checkpoint (or ``step`` only).

        ``template`` is a state tree like the one saved; its tensors (plain or
        DTensor, in any layout) are filled in place, and only after the whole
        checkpoint was read. Keys it lacks come back as full plain tensors in
        ``LoadResult.state``. Returns None when there is no checkpoint at all."""
        t0 = time.perf_counter()
        self.wait()
        candidates = self._candidates(step)
        if not candidates:
            return None
        _, mine = flatten(template, keyed=True) if template is not None else (None, {})
        skipped: list[tuple[int, str]] = []
        for s in candidates:
            reason, manifest = self._check(s, mine)
            loaded = None
            if reason is None and manifest is not None:
                loaded, reason = self._read(s, manifest, mine)
            if loaded is not None and manifest is not None:
                state = unflatten(manifest.skeleton, loaded)
                url = self.store.url_of(s)
                if skipped:
                    log.warning("loaded checkpoint step %d from %s instead", s, url)
                return LoadResult(s, url, manifest, state, skipped, time.perf_counter() - t0)
            nxt = candidates[candidates.index(s) + 1] if s != candidates[-1] else None
            then = f"falling back to step {nxt}" if nxt is not None else "no older checkpoint"
            log.error("checkpoint step %d is unusable (%s); %s", s, reason, then)
            skipped.append((s, reason or "unknown"))
        why = "; ".join(f"step {s}: {r}" for s, r in skipped)
        raise NoUsableCheckpoint(
            f"no usable checkpoint under {self.store.url}: {why}. Fix or remove the storage "
            f"root, or set checkpoint.resume = false to start without resuming."
        )

    def _candidates(self, step: int | None) -> list[int]:
        if self.coordinator:
            if step is not None:
                found = [step] if step in self.store.steps() else []
            else:
                # The step ``latest`` names first, then only older ones: a fallback never
                # goes forward, to a step the pointer never named.
                steps = self.store.steps()
                latest = self.store.latest()
                found = sorted((s for s in steps if latest is None or s <= latest), reverse=True)
                ahead = [s for s in steps if latest is not None and s > latest]
                if ahead:
                    log.warning(
                        "checkpoint steps %s under %s are newer than the latest one committed "
                        "(step %d): not loaded",
                        ", ".join(map(str, ahead)),
                        self.store.url,
                        latest,
                    )
        else:
            found = []
        return self._bcast_ints(found)

    def _check(
        self, step: int, mine: dict[str, torch.Tensor]
    ) -> tuple[str | None, Manifest | None]:
        """(reason, manifest): reason is None when every rank found step usable."""
        reason, manifest = None, None
        try:
            manifest = self.store.manifest(step)
            check_fits(manifest, mine)
            # Sizes here (cheap); every chunk's CRC as it is read (_read).
            self.store.verify(step, manifest, crc=False)
        except CheckpointError as e:
            reason = str(e)
        except OSError as e:
            reason = f"storage error ({e})"
        return self._agree_reason(reason), manifest

    def _read(
        self, step: int, manifest: Manifest, mine: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor] | None, str | None]:
        """(tensors, None), or (None, reason) on every rank if any rank failed."""
        bufs: dict[str, torch.Tensor] = {}
        for k, info in manifest.tensors.items():
            if k in mine:
                bufs[k] = torch.empty_like(mine[k])
            else:
                bufs[k] = torch.empty(info.shape, dtype=dtype_of(info.dtype))
        reason = None
        try:
            with quiet():
                dcp.load(
                    bufs,
                    storage_reader=JsonStorageReader(self.store.fs, self.store.path(step)),
                    planner=DefaultLoadPlanner(),
                    process_group=self.group,
                    no_dist=not self.distributed,
                )
        except CheckpointException as e:
            # DCP gathers each failing rank's (exception, traceback).
            first: Any = next(iter(e.failures.values()), e)
            first = first[0] if isinstance(first, tuple) else first
            reason = str(first) if isinstance(first, CheckpointError) else f"read failed ({first})"
        except CheckpointError as e:
            reason = str(e)
        except OSError as e:
            reason = f"storage error ({e})"
        reason = self._agree_reason(reason)
        if reason is not None:
            return None, reason
        # Only now, with everything read and checked on every rank, do the
        # caller's tensors change.
        for k, t in mine.items():
            t.copy_(bufs[k])
            bufs[k] = t
        return bufs, None

    # -- agreement among the group's ranks -------------------------------

    def _agree_id(self) -> str:
        mine = torch.tensor([uuid.uuid4().int >> 65], dtype=torch.int64)
        if self.distributed:
            dist.broadcast(mine, group_src=0, group=self.group)
        return f"{int(mine.item()):016x}"

    def _all_ok(self, ok: int) -> bool:
        if not self.distributed:
            return bool(ok)
        t = torch.tensor([ok], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t.item())

    def _bcast_ints(self, values: list[int]) -> list[int]:
        if not self.distributed:
            return values
        n = torch.tensor([len(values)], dtype=torch.int64)
        dist.broadcast(n, group_src=0, group=self.group)
        buf = torch.tensor(values if self.coordinator else [0] * int(n.item()), dtype=torch.int64)
        if int(n.item()):
            dist.broadcast(buf, group_src=0, group=self.group)
        return [int(x) for x in buf.tolist()]

    def _agree_reason(self, reason: str | None) -> str | None:
        """The first failing rank's reason, on every rank (None if all are fine)."""
        if not self.distributed:
            return reason
        failing = torch.tensor([self.rank if reason else self.world], dtype=torch.int64)
        dist.all_reduce(failing, op=dist.ReduceOp.MIN, group=self.group)
        src = int(failing.item())
        if src == self.world:
            return None
        buf = torch.zeros(REASON_BYTES, dtype=torch.uint8)
        if self.rank == src:
            raw = (reason or "").encode()[:REASON_BYTES]
            buf[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        dist.broadcast(buf, group_src=src, group=self.group)
        return bytes(buf.tolist()).rstrip(b"\0").decode(errors="replace")

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)


def check_fits(manifest: Manifest, mine: dict[str, torch.Tensor]) -> None:
    """Raise IncompatibleCheckpoint unless every template tensor is in the
    checkpoint with the same global shape and dtype."""
    missing = [k for k in mine if k not in manifest.tensors]
    wrong = [
        f"{k}: saved {list(manifest.tensors[k].shape)} {manifest.tensors[k].dtype}, "
        f"expected {list(t.shape)} {dtype_name(t.dtype)}"
        for k, t in mine.items()
        if k in manifest.tensors
        and (
            tuple(t.shape) != manifest.tensors[k].shape
            or dtype_name(t.dtype) != manifest.tensors[k].dtype
        )
    ]
    if missing or wrong:
        parts = []
        if missing:
            parts.append(f"{len(missing)} tensor(s) missing: {few(missing)}")
        if wrong:
            parts.append(f"{len(wrong)} of another shape or dtype (e.g. {wrong[0]})")
        raise IncompatibleCheckpoint("it does not fit this model: " + ", ".join(parts))


def few(names: list[str], n: int = 4) -> str:
    """The first ``n`` of ``names``, then how many more (for one-line errors)."""
    head = ", ".join(repr(x) for x in names[:n])
    return head + (f" and {len(names) - n} more" if len(names) > n else "")

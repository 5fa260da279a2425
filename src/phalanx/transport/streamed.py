"""A weight broadcast in buckets, received as a stream of tensors: the receiver's
engine reloads the first tensors while the later buckets are still on the wire.

Wire format: the flat buffer of :func:`phalanx.transport.collective.pack` (every
tensor sorted by name), sent as consecutive broadcasts of ``bucket`` bytes (the
last one shorter). Both sides derive the bucket boundaries from the buffer's
size and ``bucket`` alone (the collective channel's header carries both), so the
buckets need no header of their own.

Who calls what: rank 0 :func:`send_buckets`, every other rank of the group
:func:`receive_stream` with the same ``bucket``; these are collectives, each
bucket a broadcast every rank takes part in. A failed broadcast ends the
stream with a one-line :class:`~phalanx.comm.base.CommError`, raised from the
iterator at the first tensor that did not arrive whole (an engine's
``load_weights`` then rolls back: see ``rl/engine/vllm_update.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Generator, Mapping

import torch

from phalanx.comm.base import CommError, Communicator

BUCKET = 16 << 20
"""The bucket a weight channel sends in (bytes): small enough that the first tensors
reach the engine early, large enough that a broadcast's fixed cost stays small (the
bench's default, ``bench/engines.py --bucket-mb 16``)."""


def unpack(flat: torch.Tensor, like: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Split a :func:`~phalanx.transport.collective.pack` buffer back into tensors
    shaped like ``like`` (views of ``flat``, sorted by name)."""
    out, off = {}, 0
    for k, t in sorted(like.items()):
        n = t.numel() * t.element_size()
        out[k] = flat[off : off + n].view(t.dtype).view(t.shape)
        off += n
    return out


def send_buckets(comm: Communicator, flat: torch.Tensor, bucket: int) -> None:
    """Broadcast ``flat`` from rank 0, ``bucket`` bytes at a time."""
    for off in range(0, flat.numel(), bucket):
        comm.broadcast(flat[off : off + bucket], 0)


def drain_buckets(comm: Communicator, nbytes: int, bucket: int, device: torch.device) -> None:
    """Take part in a bucketed broadcast of ``nbytes`` and discard it (a receiver that
    refuses the weights still completes the collective, so the sender's succeeds)."""
    scratch = torch.empty(min(bucket, max(nbytes, 1)), dtype=torch.uint8, device=device)
    for off in range(0, nbytes, bucket):
        comm.broadcast(scratch[: min(bucket, nbytes - off)], 0)


def receive_stream(
    comm: Communicator, flat: torch.Tensor, like: Mapping[str, torch.Tensor], bucket: int
) -> Generator[tuple[str, torch.Tensor], None, None]:
    """Receive ``flat`` in buckets on a thread of its own and yield each tensor of
    ``like`` (sorted by name, views of ``flat``) as soon as its bytes are all in.

    The stream must be run to its end or closed before ``comm`` is used again: a
    close waits for the remaining buckets (the thread still takes part in their
    broadcasts, so the sender's collective completes), and raises the CommError if
    one of them failed. A broken broadcast raises CommError from the iterator at the
    first tensor it cut off, naming how far the stream got."""
    n = flat.numel()
    arrived = [0]
    failed: list[BaseException] = []
    cond = threading.Condition()

    def receive() -> None:
        try:
            for off in range(0, n, bucket):
                comm.broadcast(flat[off : off + bucket], 0)
                with cond:
                    arrived[0] = min(off + bucket, n)
                    cond.notify_all()
        except BaseException as e:  # handed to the consumer, raised there
            with cond:
                failed.append(e)
                cond.notify_all()

    def broke(done: int, total: int) -> CommError:
        why = " ".join(str(failed[0]).split())[:300]
        return CommError(
            f"the weight stream broke after {done} of {total} tensors ({arrived[0]} of {n} "
            f"bytes): {why}"
        )

    thread = threading.Thread(target=receive, name="phalanx-weights-rx", daemon=True)
    thread.start()
    end = [0]
    views = unpack(flat, like)

    def ready() -> bool:
        return arrived[0] >= end[0] or bool(failed)

    try:
        for i, (name, view) in enumerate(views.items()):
            end[0] += view.numel() * view.element_size()
            with cond:
                cond.wait_for(ready)
                if arrived[0] < end[0]:
                    raise broke(i, len(views)) from failed[0]
            yield name, view
    except GeneratorExit:  # closed early: the rest still arrives, or its failure is raised
        thread.join()
        if failed:
            raise broke(i + 1, len(views)) from failed[0]
        raise
    finally:
        thread.join()

"""A weight broadcast in buckets, received as a stream of tensors: the receiver's
engine reloads the first tensors while the later buckets are still on the wire.

Wire format: the flat buffer of :func:`phalanx.transport.collective.pack` (every
tensor sorted by name), sent as consecutive broadcasts of ``bucket`` bytes (the
last one shorter). Both sides derive the bucket boundaries from the buffer's
size and ``bucket`` alone, so the sender needs no second header.

Who calls what: rank 0 :func:`send_buckets`, every other rank of the group
:func:`receive_stream` with the same ``bucket``; these are collectives, each
bucket a broadcast every rank takes part in. A failed broadcast ends the
stream with the :class:`~phalanx.comm.base.CommError`, raised from the
iterator at the first tensor that did not arrive whole (an engine's
``load_weights`` then rolls back: see ``rl/engine/vllm_update.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping

import torch

from phalanx.comm.base import Communicator
from phalanx.transport.collective import unpack


def send_buckets(comm: Communicator, flat: torch.Tensor, bucket: int) -> None:
    """Broadcast ``flat`` from rank 0, ``bucket`` bytes at a time."""
    for off in range(0, flat.numel(), bucket):
        comm.broadcast(flat[off : off + bucket], 0)


def receive_stream(
    comm: Communicator, flat: torch.Tensor, like: Mapping[str, torch.Tensor], bucket: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Receive ``flat`` in buckets on a thread of its own and yield each tensor of
    ``like`` (sorted by name, views of ``flat``) as soon as its bytes are all in.
    The iterator must be run to its end (or the group aborted) before ``comm`` is
    used again: the thread still takes part in the remaining broadcasts."""
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

    thread = threading.Thread(target=receive, name="phalanx-weights-rx", daemon=True)
    thread.start()
    end = [0]

    def ready() -> bool:
        return arrived[0] >= end[0] or bool(failed)

    try:
        for name, view in unpack(flat, like).items():
            end[0] += view.numel() * view.element_size()
            with cond:
                cond.wait_for(ready)
                if arrived[0] < end[0]:
                    raise failed[0]
            yield name, view
    finally:
        thread.join()

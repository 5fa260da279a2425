"""Constant global batch: how a fixed ``B`` is split over ``k`` participants.

**Remainder rule.** ``B = q*k + r`` with ``0 <= r < k``: ranks ``0..r-1``
take ``q+1`` samples, the others ``q``; rank ``i`` takes the contiguous slice
starting at ``i*q + min(i, r)``. Every sample of the global batch is taken
by exactly one rank, whatever ``k`` is. When ``k > B`` the last ranks take
nothing and contribute zero gradients (they still join the all-reduce).

**Loss normalisation.** Each rank sums its per-sample losses and scales the
sum by ``1/B`` (or ``1/T`` for a global token count ``T``), then the
gradients are all-reduced as a sum. The committed gradient is then exactly
the gradient of the mean loss over the global batch, as a single process
would compute it, for any ``k`` and any split; the learning rate needs no
change when membership does.

**Accumulation.** A rank's share is cut into micro-batches of at most
``micro_batch_size`` samples; their gradients accumulate before the
all-reduce.
"""

from __future__ import annotations


def split(batch_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """Return ``(offset, count)`` of rank ``rank``'s share of the global batch."""
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}): got {rank}.")
    q, r = divmod(batch_size, world_size)
    return rank * q + min(rank, r), q + (1 if rank < r else 0)


def micro_batches(items: list[int], micro_batch_size: int) -> list[list[int]]:
    """Cut a share into micro-batches of at most ``micro_batch_size``."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1: got {micro_batch_size}.")
    return [items[i : i + micro_batch_size] for i in range(0, len(items), micro_batch_size)]

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

**Weighted split.** A quorum may carry per-rank weights (the controller gives a
straggler a smaller share: :mod:`phalanx.controller.core.stragglers`). Rank ``i``
then takes ``floor(B*w_i/W)`` samples (``W`` the sum of the weights), and the
samples left over go one each to the largest remainders ``B*w_i mod W``, ties to
the lower rank; slices stay contiguous in rank order. Equal weights give exactly
the remainder rule, and every member computes the same split from the same
weights, so the global batch is the same whoever takes which part.

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


def split_weighted(batch_size: int, weights: tuple[int, ...], rank: int) -> tuple[int, int]:
    """``(offset, count)`` of rank ``rank``'s share of the global batch, split by
    ``weights`` (one positive integer per rank: the module's weighted split)."""
    k = len(weights)
    if not 0 <= rank < k:
        raise ValueError(f"rank must be in [0, {k}): got {rank}.")
    if min(weights) < 1:
        raise ValueError(f"share weights must be >= 1: got {min(weights)}.")
    total = sum(weights)
    counts = [batch_size * w // total for w in weights]
    left = batch_size - sum(counts)
    by_remainder = sorted(range(k), key=lambda i: (-(batch_size * weights[i] % total), i))
    for i in by_remainder[:left]:
        counts[i] += 1
    return sum(counts[:rank]), counts[rank]


def share_of(
    batch_size: int, world_size: int, rank: int, weights: tuple[int, ...] = ()
) -> tuple[int, int]:
    """``(offset, count)`` of ``rank``'s share: by ``weights`` when the quorum gave one
    per rank, else the equal split."""
    if weights and len(weights) == world_size:
        return split_weighted(batch_size, weights, rank)
    return split(batch_size, world_size, rank)


def micro_batches(items: list[int], micro_batch_size: int) -> list[list[int]]:
    """Cut a share into micro-batches of at most ``micro_batch_size``."""
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1: got {micro_batch_size}.")
    return [items[i : i + micro_batch_size] for i in range(0, len(items), micro_batch_size)]

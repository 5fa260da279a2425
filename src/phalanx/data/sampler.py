"""Exactly-once elastic sampler.

The dataset of ``n`` samples is read as an endless stream of epochs, each a
permutation of ``range(n)`` drawn from ``(seed, epoch)``. A *global cursor*
``c`` counts the samples consumed by committed steps; the global batch of a
step is stream positions ``[c, c + B)``, which may straddle an epoch
boundary. The cursor advances only when a step commits, and it travels
with heal and checkpoint state, so the sequence of committed global batches
is the same whatever fails, whoever joins, and however many replicas split
each batch.

Splitting among ``k`` participants follows :func:`phalanx.train.batch.split`:
replica rank ``r`` takes a contiguous slice of the global batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ElasticSampler:
    num_samples: int
    seed: int = 0
    shuffle: bool = True
    cursor: int = 0
    """Stream position of the next uncommitted sample."""

    def __post_init__(self) -> None:
        if self.num_samples <= 0:
            raise ValueError(
                f"ElasticSampler.num_samples must be > 0: got {self.num_samples}. "
                f"The dataset is empty."
            )
        self._perm_epoch = -1
        self._perm: np.ndarray = np.arange(0)

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of epoch ``epoch``: deterministic from (seed, epoch)."""
        if epoch != self._perm_epoch:
            if self.shuffle:
                rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
                self._perm = rng.permutation(self.num_samples)
            else:
                self._perm = np.arange(self.num_samples)
            self._perm_epoch = epoch
        return self._perm

    def positions(self, start: int, count: int) -> list[int]:
        """Sample indices at stream positions ``[start, start + count)``."""
        out: list[int] = []
        pos, end = start, start + count
        while pos < end:
            epoch, off = divmod(pos, self.num_samples)
            take = min(end - pos, self.num_samples - off)
            out.extend(int(i) for i in self.permutation(epoch)[off : off + take])
            pos += take
        return out

    def global_batch(self, batch_size: int) -> list[int]:
        """The next (uncommitted) global batch."""
        return self.positions(self.cursor, batch_size)

    def commit(self, batch_size: int) -> None:
        """Advance past a committed global batch. Call only on commit."""
        self.cursor += batch_size

    @property
    def epoch(self) -> int:
        return self.cursor // self.num_samples

    def state_dict(self) -> dict[str, int]:
        return {"cursor": self.cursor, "seed": self.seed, "num_samples": self.num_samples}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        if sd["num_samples"] != self.num_samples or sd["seed"] != self.seed:
            raise ValueError(
                f"sampler state must come from the same dataset and seed: got num_samples="
                f"{sd['num_samples']}, seed={sd['seed']}, expected {self.num_samples}, {self.seed}."
            )
        self.cursor = int(sd["cursor"])

"""The ``[controller.stragglers]`` section: finding replicas that are alive but slow,
and what the controller does about them (:mod:`phalanx.controller.core.stragglers`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class StragglersSection(BaseModel):
    """A replica whose share of the step takes ``factor`` times the median of its
    peers', over ``window`` steps, is flagged: its share of the constant global batch
    shrinks in proportion to its speed. One still that slow at ``min_share`` is
    evicted. Off by default: a smaller share changes which replica sums which
    samples, so float-reduced numbers are no longer bit-identical to an equal split's
    (exact reduction keeps them so)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    enabled: bool = False
    """Watch the replicas' step times and rebalance (FT data-parallel jobs: a replica
    reports the time its share took with its next quorum request)."""
    factor: float = Field(1.5, gt=1, le=100)
    """A replica is a straggler when its share takes this many times the median of
    its peers' (each the median over ``window`` steps)."""
    window: int = Field(5, ge=1, le=1000)
    """Steps each decision looks at: to flag a replica, to evict one at the floor."""
    min_share: float = Field(0.25, gt=0, le=1)
    """The floor of a straggler's share, as a fraction of an equal share. One still
    ``factor`` times slower than its peers there for ``window`` steps is evicted."""

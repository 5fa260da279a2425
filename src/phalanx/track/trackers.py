"""The trackers a job's ``rl.track`` section asks for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from phalanx.config.rl import TrackSection
from phalanx.track.base import Tracker, Trackers


def trackers(track: TrackSection, run_dir: Path, name: str, config: dict[str, Any]) -> Trackers:
    """The trackers ``track`` asks for, writing under ``run_dir``. Raises ValueError in
    one line when one cannot start (wandb not installed)."""
    out: list[Tracker] = []
    if track.tensorboard:
        from phalanx.track.tensorboard import TensorBoardTracker

        out.append(TensorBoardTracker(run_dir / "tb"))
    if track.wandb:
        from phalanx.track.wandb import WandbTracker

        out.append(WandbTracker(track, run_dir, name, config))
    return Trackers(out)

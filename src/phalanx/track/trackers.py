"""The trackers a job's ``[track]`` section asks for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from phalanx.config.track import TrackSection
from phalanx.track.base import Tracker, Trackers


def trackers(
    track: TrackSection, run_dir: Path, name: str, config: dict[str, Any], job_id: str = "phalanx"
) -> Trackers:
    """The trackers ``track`` asks for, writing under ``run_dir`` (the run named
    ``name``, of job ``job_id``). Raises ValueError in one line when one cannot start
    (its package not installed); the ones started before it are closed first."""
    out: list[Tracker] = []
    try:
        if track.tensorboard:
            from phalanx.track.tensorboard import TensorBoardTracker

            out.append(TensorBoardTracker(run_dir / "tb"))
        if track.wandb:
            from phalanx.track.wandb import WandbTracker

            out.append(WandbTracker(track, run_dir, name, config))
        if track.mlflow:
            from phalanx.track.mlflow import MlflowTracker

            out.append(MlflowTracker(track, run_dir, name, config, job_id))
    except ValueError:
        Trackers(out).close()
        raise
    return Trackers(out)

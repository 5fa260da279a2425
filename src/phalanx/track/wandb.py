"""Weights & Biases, offline unless ``track.wandb_mode = "online"``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from phalanx.config.track import TrackSection
from phalanx.track.base import Tracker


class WandbTracker(Tracker):
    """One wandb run per job, its files under ``run_dir/wandb``."""

    def __init__(self, track: TrackSection, run_dir: Path, name: str, config: dict[str, Any]):
        try:
            import wandb
        except ImportError as e:
            raise ValueError(
                "track.wandb needs the wandb package: it is not installed. Run "
                "pip install 'phalanx[track]', or set track.wandb = false."
            ) from e
        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=track.wandb_project,
            name=name,
            mode=track.wandb_mode,
            dir=str(run_dir),
            config=config,
            reinit="create_new",
        )

    def log(self, step: int, metrics: Mapping[str, float], wall: float | None = None) -> None:
        self.run.log(dict(metrics), step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() hands the last records to wandb's service process; teardown waits
        # for that process to write them and exit (offline, they are the whole run).
        wandb.teardown()

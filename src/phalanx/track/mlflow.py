"""MLflow, through the light ``mlflow-skinny`` client: a file store in the run
directory unless ``track.mlflow_uri`` names another."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from phalanx.config.track import TrackSection
from phalanx.track.base import Tracker

ALLOW_FILE_STORE = "MLFLOW_ALLOW_FILE_STORE"
"""MLflow 3 refuses its file store unless this is ``true`` (it keeps the store, in
maintenance; a database store needs the full ``mlflow`` package, not the light
client). Set for a ``file:`` URI only; an operator's own value wins."""


def store_uri(track: TrackSection, run_dir: Path) -> str:
    """The tracking URI: ``track.mlflow_uri``, else ``file:<run dir>/mlruns``."""
    return track.mlflow_uri or (run_dir / "mlruns").absolute().as_uri()


class MlflowTracker(Tracker):
    """One MLflow run per job (named after the run directory), in the experiment
    ``track.mlflow_experiment`` (default the job id), with the resolved config as
    its ``config.json`` artifact. Each :meth:`log` is one ``log_batch``."""

    def __init__(
        self, track: TrackSection, run_dir: Path, name: str, config: dict[str, Any], job_id: str
    ):
        uri = store_uri(track, run_dir)
        if uri.startswith("file:"):
            os.environ.setdefault(ALLOW_FILE_STORE, "true")
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as e:
            raise ValueError(
                "track.mlflow needs the mlflow-skinny package: it is not installed. Run "
                "pip install 'phalanx[track]', or set track.mlflow = false."
            ) from e
        run_dir.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(tracking_uri=uri)
        experiment = track.mlflow_experiment or job_id
        found = self.client.get_experiment_by_name(experiment)
        exp_id = found.experiment_id if found else self.client.create_experiment(experiment)
        run = self.client.create_run(exp_id, run_name=name, tags={"phalanx.job": job_id})
        self.run_id = run.info.run_id
        self.uri = uri
        if config:
            self.client.log_text(self.run_id, json.dumps(config, indent=1), "config.json")

    def log(self, step: int, metrics: Mapping[str, float], wall: float | None = None) -> None:
        from mlflow.entities import Metric

        ms = int((wall or time.time()) * 1000)
        batch = [Metric(k, float(v), ms, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)

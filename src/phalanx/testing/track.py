"""Read back what the trackers wrote, as ``{metric: [(step, value), ...]}``, for the
tests: TensorBoard event files and an MLflow file store."""

from __future__ import annotations

import os
from pathlib import Path


def tensorboard_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files under ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def mlflow_metrics(store: Path, experiment: str) -> dict[str, list[tuple[int, float]]]:
    """Every metric of the one run of ``experiment`` in the MLflow file store ``store``."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # see phalanx.track.mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=store.absolute().as_uri())
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        raise AssertionError(f"no experiment {experiment!r} in {store}")
    runs = client.search_runs([exp.experiment_id])
    if len(runs) != 1:
        raise AssertionError(f"experiment {experiment!r} must hold one run: got {len(runs)}")
    rid = runs[0].info.run_id
    return {
        k: [(m.step, m.value) for m in client.get_metric_history(rid, k)]
        for k in runs[0].data.metrics
    }

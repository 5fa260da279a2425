"""The ``[track]`` section: experiment tracking, for every job kind.

One writer logs a job's metrics (the launcher, one agent, or the Ray driver:
:mod:`phalanx.track`), under its run directory. RL jobs used to say this under
``[rl.track]``; that table is still read (:func:`merge_rl_track`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class TrackSection(BaseModel):
    """Experiment tracking. Offline by default: TensorBoard event files in the run
    directory (``<run>/tb``); wandb and MLflow only when turned on, wandb offline
    unless told, MLflow to a file store in the run directory unless told."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    tensorboard: bool = True
    """Write TensorBoard event files under ``<run dir>/tb``."""
    wandb: bool = False
    """Also log to Weights & Biases (``pip install 'phalanx[track]'``)."""
    wandb_project: str = Field("phalanx", min_length=1, max_length=128)
    """The wandb project the run goes to."""
    wandb_mode: Literal["offline", "online"] = "offline"
    """``offline`` writes the run under ``<run dir>/wandb`` for ``wandb sync`` later;
    ``online`` sends it (needs a login and a network)."""
    mlflow: bool = False
    """Also log to MLflow (``pip install 'phalanx[track]'``: the ``mlflow-skinny``
    client)."""
    mlflow_uri: str | None = Field(None, min_length=1, max_length=1024)
    """The MLflow tracking URI: ``http(s)://`` for a tracking server, or any store
    the installed client knows. None: a file store, ``<run dir>/mlruns``
    (``mlflow ui --backend-store-uri <run dir>/mlruns`` shows it)."""
    mlflow_experiment: str | None = Field(None, min_length=1, max_length=256)
    """The MLflow experiment the run goes to (made if missing). None: the job's id."""
    peak_tflops: float | None = Field(None, gt=0, le=1e6)
    """The device's peak TFLOP/s in ``grpo.precision``, for MFU. None: known NVIDIA
    data-centre GPUs are looked up; elsewhere (CPU) MFU is not reported."""


def merge_rl_track(data: Any) -> Any:
    """A job file's raw data with ``[rl.track]`` (the RL jobs' old place) folded into
    ``[track]``, and ``[rl.track]`` set to the result, so that both read the same.
    A key given in both with different values raises ValueError in one line."""
    if not isinstance(data, dict) or not isinstance(data.get("rl"), dict):
        return data
    rl, new = data["rl"], data.get("track")
    old = rl.get("track")
    if old is None:  # [rl.track] reads [track]
        return data if new is None else {**data, "rl": {**rl, "track": new}}
    if not isinstance(old, dict) or not isinstance(new, dict | None):
        return data  # not tables: the model's validation says so
    new = new or {}
    clash = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
    if clash:
        k = clash[0]
        raise ValueError(
            f"track.{k} must be given once: got {new[k]!r} in [track] and {old[k]!r} in "
            f"[rl.track]. Keep [track] (every job kind reads it) and drop [rl.track]."
        )
    merged = {**old, **new}
    return {**data, "track": merged, "rl": {**rl, "track": merged}}

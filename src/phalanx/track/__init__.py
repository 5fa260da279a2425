"""Experiment tracking: a job's metrics to TensorBoard event files, wandb and MLflow,
logged once per job by whoever reads its replicas' lines (:mod:`phalanx.track.job`)."""

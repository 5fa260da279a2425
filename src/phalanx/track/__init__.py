"""Experiment tracking: the job's metrics to TensorBoard event files and wandb."""

"""Typed job config (pydantic): one TOML file per job, with dotted CLI overrides.

- ``job.py``   the job's sections (job, timeouts, roles, controller, checkpoint,
               replica), the checks across them, and :func:`load_config`
- ``train.py`` the training job's sections (train, diloco)
- ``rl.py``    the RL sections (model, task, grpo, loop, transport)
- ``file.py``  TOML reading, overrides, and errors in one line
"""

from phalanx.config.file import ConfigError, apply_overrides, explain, read_toml
from phalanx.config.job import (
    ROLE_NAMES,
    CheckpointSection,
    ControllerSection,
    DiLoCoSection,
    JobConfig,
    JobSection,
    RoleSection,
    TimeoutsSection,
    TrainSection,
    load_config,
)

__all__ = [
    "ROLE_NAMES",
    "CheckpointSection",
    "ConfigError",
    "ControllerSection",
    "DiLoCoSection",
    "JobConfig",
    "JobSection",
    "RoleSection",
    "TimeoutsSection",
    "TrainSection",
    "apply_overrides",
    "explain",
    "load_config",
    "read_toml",
]

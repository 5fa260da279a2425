"""``[rl.env]``: load the environment a job names, and its dataset's rows.

``rl.env.module`` names a module whose ``load_environment(**rl.env.args)``
returns a ``verifiers`` environment (``verifiers``' own convention for
environment packages), or ``module:function`` for another factory. What goes
wrong is one line naming it: a module that does not import, a missing
factory, a factory that raises or returns something that is not an
environment, an environment with no dataset.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from phalanx.config.rl_env import EnvSection, env_args


class EnvLoadError(ValueError):
    """The environment named by ``rl.env.module`` cannot be loaded (one line)."""


@dataclass
class LoadedEnv:
    """A ``verifiers`` environment with its dataset's rows as rollout inputs."""

    env: Any
    rows: list[dict[str, Any]]
    budget: int
    """``rl.env.max_episode_tokens``."""
    overlong: type[Exception]
    """What the client raises past the budget: ``verifiers``' OverlongPromptError, which
    ends the episode as truncated."""

    def row(self, index: int) -> dict[str, Any]:
        """The rollout input of prompt ``index``: row ``index`` mod the dataset's size."""
        return self.rows[index % len(self.rows)]


def load_env(section: EnvSection) -> LoadedEnv:
    """Import and build ``section``'s environment; EnvLoadError in one line."""
    import datasets
    import verifiers as vf

    from phalanx.rl.sandbox.base import SandboxError, SandboxLimits
    from phalanx.rl.sandbox.tools import configure

    datasets.disable_progress_bars()  # (verifiers maps its dataset: no bar on a job's output)
    configure(SandboxLimits(time_s=section.sandbox_time_s, memory_mb=section.sandbox_memory_mb))
    spec = section.module
    mod_name, _, attr = spec.partition(":")
    attr = attr or "load_environment"
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:
        raise EnvLoadError(
            f"rl.env.module {mod_name!r} does not import: {type(e).__name__}: "
            f"{' '.join(str(e).split())[:200]}. Install it or put its directory on PYTHONPATH."
        ) from e
    factory = getattr(mod, attr, None)
    if not callable(factory):
        raise EnvLoadError(
            f"rl.env.module {mod_name!r} has no function {attr!r}: an environment module "
            f"defines load_environment(**args), or name another as {mod_name}:function."
        )
    try:
        env = factory(**env_args(section))
    except SandboxError as e:  # its tools need a sandbox this machine cannot make
        raise EnvLoadError(f"rl.env.module {spec!r}: {e}") from e
    except Exception as e:
        raise EnvLoadError(
            f"rl.env.module {spec!r}: {attr}(**rl.env.args) failed: {type(e).__name__}: "
            f"{' '.join(str(e).split())[:200]}. Check rl.env.args against its parameters."
        ) from e
    if not isinstance(env, vf.Environment):
        raise EnvLoadError(
            f"rl.env.module {spec!r}: {attr}() must return a verifiers Environment "
            f"(MultiTurnEnv, ToolEnv, ...): got a {type(env).__name__}."
        )
    try:
        data = env.get_dataset()
    except Exception as e:
        raise EnvLoadError(
            f"rl.env.module {spec!r}: the environment has no dataset to draw prompts from "
            f"({type(e).__name__}: {' '.join(str(e).split())[:150]}). Give it one."
        ) from e
    rows = [dict(r) for r in data]
    if not rows:
        raise EnvLoadError(f"rl.env.module {spec!r}: the environment's dataset is empty.")
    return LoadedEnv(env, rows, section.max_episode_tokens, vf.OverlongPromptError)

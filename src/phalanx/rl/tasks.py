"""Tasks: the built-in digit sort, and JSONL prompts scored by a ``module:function`` reward.

Sort task (``sort4``)
    prompt ``3142>``, answer ``1234`` then EOS. Digits are drawn with
    replacement from 0-9, deterministically from ``(seed, index)``. The reward
    gives partial credit per position, EOS included: 5 positions worth 0.2
    each (4 digits, then EOS right after the 4th digit). Exact match is all 5.

JSONL task (``jsonl``)
    one JSON object per line, ``{"prompt": "...", "answer": "..."}`` (answer
    optional; other keys are kept). The reward is a Python callable named as
    ``package.module:function`` and called as
    ``fn(prompt, completion, **extra)``, where ``extra`` holds ``finished`` and
    the row's other keys (``answer`` ...), passed only when the function's
    signature names them or takes ``**kwargs``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from phalanx.config.rl import TaskSection
from phalanx.rl.base import RowTask, Task
from phalanx.rl.rewards import RewardFn, accepted_kwargs, load_reward_fn


class SortTask(Task):
    """Sort ``length`` digits: ``3142>`` -> ``1234`` + EOS."""

    name = "sort4"
    SEP = ">"

    def __init__(self, seed: int = 0, length: int = 4):
        if length < 1:
            raise ValueError(f"length must be >= 1: got {length}. Sort at least one digit.")
        self.seed, self.length = seed, length

    @property
    def num_prompts(self) -> int | None:
        return None

    def prompt(self, index: int) -> str:
        if index < 0:
            raise ValueError(f"prompt index must be >= 0: got {index}.")
        # A string seed is hashed with SHA-512 by random.Random: stable across processes.
        rng = random.Random(f"sort:{self.seed}:{index}")
        return "".join(rng.choice("0123456789") for _ in range(self.length)) + self.SEP

    def answer(self, prompt: str) -> str:
        return "".join(sorted(prompt.removesuffix(self.SEP)))

    def reward(self, prompt: str, completion: str, finished: bool) -> float:
        answer = self.answer(prompt)
        hits = sum(i < len(completion) and completion[i] == c for i, c in enumerate(answer))
        # The EOS position counts only when EOS came right after len(answer) tokens.
        hits += finished and len(completion) == len(answer)
        return hits / (len(answer) + 1)

    def exact_match(self, prompt: str, completion: str, finished: bool) -> bool:
        return finished and completion == self.answer(prompt)


class JsonlTask(RowTask):
    """Prompts from a JSONL file, scored by a user reward function.

    Exact match is ``finished and completion.strip() == answer.strip()`` when
    the row has an ``answer``, else ``reward >= 1.0``.
    """

    name = "jsonl"

    def __init__(self, path: str | Path, reward: str | RewardFn):
        self.path = Path(path)
        self.rows = _read_jsonl(self.path)
        self.reward_fn = load_reward_fn(reward) if isinstance(reward, str) else reward
        self._filter = accepted_kwargs(self.reward_fn)
        self._by_prompt = {row["prompt"]: row for row in self.rows}

    def reward(self, prompt: str, completion: str, finished: bool) -> float:
        row = self._by_prompt.get(prompt, {})
        extra = {k: v for k, v in row.items() if k != "prompt"} | {"finished": finished}
        value = self.reward_fn(prompt, completion, **self._filter(extra))
        try:
            return float(value)
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"reward function must return a number: got {value!r} for prompt {prompt!r}. "
                f"Return a float."
            ) from e

    def exact_match(self, prompt: str, completion: str, finished: bool) -> bool:
        answer = self._by_prompt.get(prompt, {}).get("answer")
        if answer is None:
            return self.reward(prompt, completion, finished) >= 1.0
        return finished and completion.strip() == str(answer).strip()


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise FileNotFoundError(f"task.path must be an existing JSONL file: got {str(path)!r}.")
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno} must be one JSON object per line: {e}.") from e
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise ValueError(
                f"{path}:{lineno} must be an object with a string 'prompt': got {line[:80]!r}. "
                f'Write rows like {{"prompt": "...", "answer": "..."}}.'
            )
        rows.append(row)
    if not rows:
        raise ValueError(f"task.path {path} must hold at least one prompt: got an empty file.")
    return rows


def build_task(
    name: str, seed: int = 0, path: str | None = None, reward: str | None = None
) -> Task:
    """The task named ``name`` (``sort4`` or ``jsonl``) from its config fields."""
    if name == "sort4":
        return SortTask(seed=seed)
    if name == "jsonl":
        if path is None or reward is None:
            raise ValueError(
                f"a jsonl task must have a path and a reward: got path={path!r}, "
                f"reward={reward!r}. Set task.path and task.reward."
            )
        return JsonlTask(path, reward)
    raise ValueError(f"task name must be 'sort4' or 'jsonl': got {name!r}.")


def task_from_config(t: TaskSection) -> Task:
    """The task of a job's ``[rl.task]`` section. Raises ValueError in one line when
    its file, fields or reward functions are wrong."""
    if t.name == "dataset":
        from phalanx.rl.dataset_task import DatasetTask
        from phalanx.rl.rewards import Rewards

        if t.path is None:
            raise ValueError("task.path must name the dataset file: got none.")
        rewards = Rewards(
            t.rewards,
            t.reward_weights,
            format_pattern=t.format_pattern,
            timeout_s=t.reward_timeout_s,
        )
        return DatasetTask(t.path, rewards, t.prompt_field, t.answer_field)
    return build_task(t.name, t.seed, t.path, t.reward)

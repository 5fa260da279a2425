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

import importlib
import inspect
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from phalanx.rl.base import Task


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


RewardFn = Callable[..., float]


def load_reward_fn(spec: str) -> RewardFn:
    """Import ``package.module:function`` and check that it can be called as ``fn(prompt, completion)``.

    Raises ValueError when the spec is malformed, the module cannot be
    imported, the attribute is missing, or it is not a callable taking two
    positional arguments; the import error, if any, is attached as the cause.
    """
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise ValueError(
            f"reward must look like 'package.module:function': got {spec!r}. Name the module, "
            f"a colon, then the function."
        )
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ValueError(
            f"reward module must be importable: got {mod_name!r}, which fails with "
            f"{type(e).__name__}: {e}. Install it or put its directory on PYTHONPATH."
        ) from e
    obj: Any = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(
                f"reward function must exist in its module: got {spec!r}, but {mod_name} has "
                f"no attribute {attr!r}. Check the function's name."
            )
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(
            f"reward must be callable: got {spec!r}, a {type(obj).__name__}. Point it at a "
            f"function fn(prompt, completion, **extra) -> float."
        )
    try:
        inspect.signature(obj).bind_partial("prompt", "completion")
    except TypeError as e:
        raise ValueError(
            f"reward function must accept (prompt, completion): {spec!r} has signature "
            f"{inspect.signature(obj)}. Give it two positional parameters."
        ) from e
    except ValueError:  # builtins without a signature: trust them
        pass
    return obj


def _accepted(fn: RewardFn) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """Filter for the keyword arguments ``fn`` declares (all of them if it takes ``**kwargs``)."""
    try:
        params = inspect.signature(fn).parameters
    except ValueError:
        return lambda kw: {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return lambda kw: kw
    names = {
        n for n, p in list(params.items())[2:] if p.kind is not inspect.Parameter.VAR_POSITIONAL
    }
    return lambda kw: {k: v for k, v in kw.items() if k in names}


class JsonlTask(Task):
    """Prompts from a JSONL file, scored by a user reward function.

    Exact match is ``finished and completion.strip() == answer.strip()`` when
    the row has an ``answer``, else ``reward >= 1.0``.
    """

    name = "jsonl"

    def __init__(self, path: str | Path, reward: str | RewardFn):
        self.path = Path(path)
        self.rows = _read_jsonl(self.path)
        self.reward_fn = load_reward_fn(reward) if isinstance(reward, str) else reward
        self._filter = _accepted(self.reward_fn)
        self._by_prompt = {row["prompt"]: row for row in self.rows}

    @property
    def num_prompts(self) -> int | None:
        return len(self.rows)

    def prompt(self, index: int) -> str:
        if not 0 <= index < len(self.rows):
            raise ValueError(
                f"prompt index must be in [0, {len(self.rows)}): got {index}. Use "
                f"Task.prompts(), which wraps around."
            )
        return self.rows[index]["prompt"]

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

"""Prompts from a local dataset file, through the ``datasets`` library, scored by
weighted reward functions (:mod:`phalanx.rl.rewards`).

``task.path`` is a JSONL or JSON file (``.jsonl``, ``.json``), a Parquet file
(``.parquet``), an Arrow file (``.arrow``) or a directory written by
``Dataset.save_to_disk``. ``task.prompt_field`` and ``task.answer_field`` name
the columns (``answer_field = ""``: rows have no answer); every other column
reaches user reward functions by name.

Bad rows (no prompt, a prompt that is not a non-empty string, a missing or
non-scalar answer) are left out, counted, and reported once with their row
numbers (1-based, in file order); they never stop the job. Prompt indices run
over the good rows in file order, so every process that loads the same file
numbers them alike: the controller's exactly-once cursor and keyed sampling
work as on any task.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from phalanx.rl.base import RowTask
from phalanx.rl.rewards import Rewards

log = logging.getLogger("phalanx.rl.dataset_task")

BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


def load_rows(path: str | Path) -> tuple[list[str], list[dict[str, Any]]]:
    """(column names, rows) of a local dataset file or ``save_to_disk`` directory.
    Raises ValueError in one line when it cannot be read."""
    p = Path(path)
    if not p.exists():
        raise ValueError(
            f"task.path must be an existing dataset file or directory: got {str(p)!r}."
        )
    import datasets

    datasets.disable_progress_bars()
    try:
        if p.is_dir():
            ds: Any = datasets.load_from_disk(str(p))
        elif p.suffix in BUILDERS:
            ds = datasets.load_dataset(BUILDERS[p.suffix], data_files=str(p), split="train")
        else:
            raise ValueError(
                f"task.path must end in one of {sorted(BUILDERS)} or be a save_to_disk "
                f"directory: got {str(p)!r}."
            )
    except ValueError:
        raise
    except Exception as e:  # the library's own errors: unreadable, corrupt, empty
        raise ValueError(
            f"task.path {str(p)!r} could not be read as a dataset: {type(e).__name__}: "
            f"{str(e).splitlines()[0][:200] if str(e) else ''}"
        ) from e
    if isinstance(ds, datasets.DatasetDict):
        split = "train" if "train" in ds else next(iter(ds))
        ds = ds[split]
    return list(ds.column_names), list(ds)


class DatasetTask(RowTask):
    """Prompts and answers from a dataset; rewards from :class:`Rewards`."""

    name = "dataset"

    def __init__(
        self,
        path: str | Path,
        rewards: Rewards,
        prompt_field: str = "prompt",
        answer_field: str = "answer",
    ):
        self.path, self.rewards = Path(path), rewards
        columns, raw = load_rows(self.path)
        for what, field in (("prompt_field", prompt_field), ("answer_field", answer_field)):
            if field and field not in columns:
                raise ValueError(
                    f"task.{what} must be a column of {self.path}: got {field!r}; its columns "
                    f"are {columns}. Set task.{what} to one of them."
                )
        self.prompt_field, self.answer_field = prompt_field, answer_field
        self.rows: list[dict[str, Any]] = []
        self.bad: list[tuple[int, str]] = []
        """(row number, why) of every row left out."""
        for i, row in enumerate(raw, 1):
            why = self._check(row)
            if why:
                self.bad.append((i, why))
            else:
                self.rows.append(row)
        if self.bad:
            shown = ", ".join(f"row {n}: {why}" for n, why in self.bad[:5])
            more = f" (and {len(self.bad) - 5} more)" if len(self.bad) > 5 else ""
            log.warning(
                "%s: %d bad row(s) left out of %d: %s%s",
                self.path,
                len(self.bad),
                len(raw),
                shown,
                more,
            )
        if not self.rows:
            raise ValueError(
                f"task.path {self.path} must hold at least one good row: got {len(raw)} rows, "
                f"all bad ({self.bad[0][1] if self.bad else 'the file is empty'})."
            )
        self._by_prompt = {r[prompt_field]: r for r in self.rows}

    def _check(self, row: dict[str, Any]) -> str:
        p = row.get(self.prompt_field)
        if not isinstance(p, str) or not p.strip():
            got = "missing" if p is None else f"a {type(p).__name__}"
            return f"{self.prompt_field} must be a non-empty string, got {got}"
        if self.answer_field:
            a = row.get(self.answer_field)
            if a is None:
                return f"{self.answer_field} is missing"
            if isinstance(a, bool) or not isinstance(a, str | int | float):
                return f"{self.answer_field} must be a string or a number, got a {type(a).__name__}"
        return ""

    def _extra(self, prompt: str, finished: bool) -> dict[str, Any]:
        row = self._by_prompt.get(prompt, {})
        extra = {k: v for k, v in row.items() if k != self.prompt_field}
        if self.answer_field:
            extra["answer"] = row.get(self.answer_field)
        return extra | {"finished": finished}

    def reward(self, prompt: str, completion: str, finished: bool) -> float:
        return self.score(prompt, completion, finished)[0]

    def exact_match(self, prompt: str, completion: str, finished: bool) -> bool:
        return self.score(prompt, completion, finished)[1]

    def score(self, prompt: str, completion: str, finished: bool) -> tuple[float, bool]:
        """(reward, exact match) with each reward function called once: exact match is
        the ``math`` reward's verdict when it is one of the rewards, else the answer
        string itself after stripping."""
        extra = self._extra(prompt, finished)
        total, values = self.rewards.parts(prompt, completion, extra)
        answer = extra.get("answer")
        if answer is None:
            return total, False
        if "math" in values:
            return total, finished and values["math"] == 1.0
        return total, finished and completion.strip() == str(answer).strip()

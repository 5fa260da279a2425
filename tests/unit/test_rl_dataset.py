"""Dataset tasks: prompts from JSONL, Parquet and Arrow files through the `datasets`
library, bad rows counted by row number, math-verify and format rewards combined
with weights, and reward functions that raise or hang."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from phalanx.config import ConfigError
from phalanx.config.rl import TaskSection, load_rl_config
from phalanx.rl.dataset_task import DatasetTask
from phalanx.rl.rewards import RewardError, Rewards, math_reward
from phalanx.rl.tasks import task_from_config

ROWS = [
    {"question": "What is 2 + 3?", "answer": "5", "level": 1},
    {"question": "Half of 1?", "answer": "\\frac{1}{2}", "level": 2},
    {"question": "7 * 6?", "answer": 42, "level": 1},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def jsonl(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "math.jsonl", ROWS)


def task(path: Path, *rewards: str, weights=None, **kw) -> DatasetTask:
    return DatasetTask(path, Rewards(rewards or ("math",), weights), "question", **kw)


def test_prompts_come_in_file_order_from_jsonl_parquet_and_arrow(tmp_path: Path, jsonl: Path):
    import datasets

    ds = datasets.Dataset.from_list([{**r, "answer": str(r["answer"])} for r in ROWS])
    ds.to_parquet(str(tmp_path / "math.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    for path in (jsonl, tmp_path / "math.parquet", arrow, tmp_path / "saved"):
        t = task(path)
        assert t.num_prompts == 3 and t.bad == []
        assert t.prompts(0, 4) == [r["question"] for r in ROWS] + [ROWS[0]["question"]]


def test_math_reward_is_math_verify_equivalence(jsonl: Path):
    t = task(jsonl)
    assert t.score("What is 2 + 3?", "2 + 3 = 5, so the answer is \\boxed{5}", True) == (1.0, True)
    assert t.score("Half of 1?", "It is 0.5", True) == (1.0, True)
    assert t.score("Half of 1?", "It is 1/2", True) == (1.0, True)
    assert t.score("7 * 6?", "#### 42", True) == (1.0, True)
    assert t.score("7 * 6?", "#### 41", True) == (0.0, False)
    assert t.score("7 * 6?", "#### 42", False)[1] is False  # cut off: not an exact match
    assert math_reward("p", "42", answer=None) == 0.0


def test_rewards_combine_with_weights_and_reach_user_functions(jsonl: Path, tmp_path: Path):
    mod = tmp_path / "my_rewards.py"
    mod.write_text(
        "def level_bonus(prompt, completion, level):\n"
        "    return 0.1 * level\n"
        "def brief(prompt, completion, **kw):\n"
        "    return 1.0 if len(completion) < 12 and kw['finished'] else 0.0\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        t = task(jsonl, "math", "format", "my_rewards:level_bonus", weights=[1.0, 0.5, 2.0])
        r, em = t.score("Half of 1?", "\\boxed{0.5}", True)
        assert em and r == pytest.approx(1.0 + 0.5 + 2 * 0.2)
        r, em = t.score("Half of 1?", "0.5 and more words", True)  # no boxed/#### ending
        assert em and r == pytest.approx(1.0 + 0.0 + 0.4)
        # Without math among the rewards, exact match is the answer string itself.
        t = task(jsonl, "my_rewards:brief")
        assert t.score("7 * 6?", "42", True) == (1.0, True)
        assert t.score("7 * 6?", "42.0", True) == (1.0, False)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("my_rewards", None)


def test_format_reward_follows_the_pattern():
    r = Rewards(["format"])
    assert r("p", "so \\boxed{7}", {"finished": True}) == 1.0
    assert r("p", "lines\n#### 7\n", {"finished": True}) == 1.0
    assert r("p", "so \\boxed{7}", {"finished": False}) == 0.0  # cut off
    assert r("p", "the answer is 7", {"finished": True}) == 0.0
    assert Rewards(["format"], format_pattern=r"Answer: \d+$")("p", "Answer: 7", {}) == 1.0


def test_bad_rows_are_left_out_counted_and_reported_with_their_row_numbers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
):
    path = tmp_path / "mixed.jsonl"
    path.write_text(
        json.dumps({"question": "1 + 1?", "answer": "2"})
        + "\n"
        + json.dumps({"question": "no answer"})
        + "\n"
        + json.dumps({"question": 7, "answer": "7"})
        + "\n"
        + json.dumps({"question": "", "answer": "0"})
        + "\n"
        + json.dumps({"question": "list answer", "answer": [1, 2]})
        + "\n"
        + json.dumps({"question": "3 + 3?", "answer": 6})
        + "\n"
    )
    with caplog.at_level("WARNING"):
        t = task(path)
    assert t.prompts(0, 2) == ["1 + 1?", "3 + 3?"]
    assert [n for n, _ in t.bad] == [2, 3, 4, 5]
    assert "answer is missing" in t.bad[0][1] and "question must be a non-empty" in t.bad[1][1]
    assert "answer must be a string or a number" in t.bad[3][1]
    (line,) = [r.getMessage() for r in caplog.records if "bad row" in r.getMessage()]
    assert "4 bad row(s) left out of 6: row 2: answer is missing" in line


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: p / "nope.jsonl", "task.path must be an existing dataset file"),
        (lambda p: write_jsonl(p / "x.csv", ROWS), "task.path must end in one of"),
        (lambda p: write_jsonl(p / "empty.jsonl", []), "could not be read as a dataset"),
        (
            lambda p: write_jsonl(p / "bad.jsonl", [{"question": None, "answer": "1"}]),
            "must hold at least one good row",
        ),
    ],
)
def test_unusable_datasets_fail_in_one_line(tmp_path: Path, setup, message):
    with pytest.raises(ValueError, match=message) as e:
        task(setup(tmp_path))
    assert "\n" not in str(e.value)


def test_field_names_are_checked_against_the_columns(jsonl: Path):
    with pytest.raises(ValueError, match=r"task.prompt_field must be a column .* 'prompt'"):
        DatasetTask(jsonl, Rewards(["math"]))
    with pytest.raises(ValueError, match=r"task.answer_field .* 'solution'.*'question'"):
        DatasetTask(jsonl, Rewards(["math"]), "question", "solution")
    assert DatasetTask(jsonl, Rewards(["format"]), "question", "").num_prompts == 3


def test_reward_specs_are_checked():
    with pytest.raises(ValueError, match="built-in reward \\['math', 'format'\\]"):
        Rewards(["mathh"])
    with pytest.raises(ValueError, match="must exist in its module"):
        Rewards(["phalanx.rl.rewards:nope"])
    with pytest.raises(ValueError, match="one weight per reward"):
        Rewards(["math", "format"], [1.0])


def test_a_reward_that_raises_or_hangs_or_returns_junk_is_a_reward_error(tmp_path: Path):
    mod = tmp_path / "bad_rewards.py"
    mod.write_text(
        "import time\n"
        "def boom(prompt, completion):\n"
        "    raise ZeroDivisionError('bad row')\n"
        "def hang(prompt, completion):\n"
        "    while True:\n"
        "        time.sleep(0.01)\n"
        "def junk(prompt, completion):\n"
        "    return 'high'\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(RewardError, match="reward bad_rewards:boom raised ZeroDivisionError"):
            Rewards(["bad_rewards:boom"])("p", "c", {})
        # The loop never ends by itself: the timer stops it.
        with pytest.raises(RewardError, match=r"bad_rewards:hang timed out after 0\.2 s"):
            Rewards(["bad_rewards:hang"], timeout_s=0.2)("p", "c", {})
        with pytest.raises(RewardError, match="must return a number: got 'high'"):
            Rewards(["bad_rewards:junk"])("p", "c", {})
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("bad_rewards", None)


def test_the_task_section_builds_a_dataset_task(jsonl: Path, tmp_path: Path):
    t = task_from_config(
        TaskSection(
            name="dataset",
            path=str(jsonl),
            prompt_field="question",
            rewards=["math", "format"],
            reward_weights=[1.0, 0.1],
        )
    )
    assert isinstance(t, DatasetTask) and t.rewards.weights == [1.0, 0.1]
    cfg = tmp_path / "rl.toml"
    for body, message in [
        ('[task]\nname = "dataset"\n', "task.path must be set"),
        (
            f'[task]\nname = "dataset"\npath = "{jsonl}"\nrewards = ["math"]\n'
            "reward_weights = [1.0, 2.0]\n",
            "one weight per reward",
        ),
        (f'[task]\nname = "dataset"\npath = "{jsonl}"\nformat_pattern = "(["\n', "regular"),
    ]:
        cfg.write_text(body)
        with pytest.raises(ConfigError, match=message):
            load_rl_config(cfg)


def test_the_arithmetic_generator_writes_a_dataset_the_math_reward_scores(tmp_path: Path):
    import subprocess

    out = tmp_path / "arith.jsonl"
    script = Path(__file__).parents[2] / "examples" / "make_arithmetic.py"
    for path in (out, tmp_path / "again.jsonl"):
        subprocess.run([sys.executable, str(script), str(path), "--n", "30"], check=True)
    assert out.read_bytes() == (tmp_path / "again.jsonl").read_bytes()  # seeded
    t = task(out)
    assert t.num_prompts == 30 and t.bad == []
    for row in t.rows[:10]:
        q, ans = row["question"], row["answer"]
        assert q.endswith("Give the final answer after ####.")
        assert t.score(q, f"Let me think.\n#### {ans}", True) == (1.0, True)
        assert t.score(q, f"#### {int(ans) + 1}", True) == (0.0, False)

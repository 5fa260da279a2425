"""Tasks: the sort reward, deterministic prompts, JSONL prompts with a module:function reward."""

from __future__ import annotations

import json
import sys

import pytest

from phalanx.rl.tasks import JsonlTask, SortTask, build_task, load_reward_fn


def test_sort_prompts_are_deterministic_and_well_formed():
    a, b = SortTask(seed=3), SortTask(seed=3)
    prompts = a.prompts(0, 50)
    assert prompts == b.prompts(0, 50)
    assert prompts[10:20] == a.prompts(10, 10)
    assert prompts != SortTask(seed=4).prompts(0, 50)
    assert all(len(p) == 5 and p.endswith(">") and p[:4].isdigit() for p in prompts)
    assert len(set(prompts)) > 40


@pytest.mark.parametrize(
    ("completion", "finished", "reward"),
    [
        ("1234", True, 1.0),  # exact: 4 digits and EOS
        ("1234", False, 0.8),  # cut off before EOS: the EOS position earns nothing
        ("1243", True, 0.6),  # two digits right, EOS in place
        ("4321", True, 0.2),  # no digit right, EOS in place
        ("123", True, 0.6),  # EOS too early: 3 digits, no credit for EOS or the 4th
        ("12345", False, 0.8),  # no EOS after the 4th digit
        ("", True, 0.0),
        ("9999", False, 0.0),
    ],
)
def test_sort_reward_partial_credit(completion, finished, reward):
    task = SortTask()
    assert task.reward("3142>", completion, finished) == pytest.approx(reward)
    assert task.exact_match("3142>", completion, finished) == (reward == 1.0)


def test_sort_answer_keeps_repeats():
    task = SortTask()
    assert task.answer("9090>") == "0099"
    assert task.reward("9090>", "0099", True) == 1.0


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    (tmp_path / "myrewards.py").write_text(
        "def contains(prompt, completion):\n"
        "    return float(prompt in completion)\n"
        "def graded(prompt, completion, answer, finished):\n"
        "    return (completion == answer) + 0.5 * finished\n"
        "def anything(prompt, completion, **kw):\n"
        "    return float(len(kw))\n"
        "def one_arg(completion):\n"
        "    return 1.0\n"
        "NOT_CALLABLE = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "myrewards"
    sys.modules.pop("myrewards", None)


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "ab", "answer": "ba"}, {"prompt": "xy", "answer": "yx", "level": 2}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path


def test_jsonl_task_calls_reward_with_declared_arguments(jsonl, reward_module):
    task = JsonlTask(jsonl, f"{reward_module}:graded")
    assert task.num_prompts == 2
    assert task.prompts(0, 3) == ["ab", "xy", "ab"]
    assert task.reward("ab", "ba", True) == 1.5
    assert task.reward("ab", "ba", False) == 1.0
    assert task.exact_match("xy", " yx ", True)
    assert not task.exact_match("xy", "yx", False)
    # Two-argument functions get no extras; **kw functions get them all.
    assert JsonlTask(jsonl, f"{reward_module}:contains").reward("ab", "xxab", True) == 1.0
    assert JsonlTask(jsonl, f"{reward_module}:anything").reward("xy", "", True) == 3.0


def test_build_task(jsonl, reward_module):
    assert isinstance(build_task("sort4", seed=1), SortTask)
    assert isinstance(
        build_task("jsonl", path=str(jsonl), reward=f"{reward_module}:contains"), JsonlTask
    )
    with pytest.raises(ValueError, match="must have a path and a reward"):
        build_task("jsonl", path=str(jsonl))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "must look like 'package.module:function'"),
        ("nonexistent_mod_xyz:f", "reward module must be importable: got 'nonexistent_mod_xyz'"),
        ("{mod}:missing", "has no attribute 'missing'"),
        ("{mod}:NOT_CALLABLE", "reward must be callable: got .*, a int"),
        ("{mod}:one_arg", r"must accept \(prompt, completion\)"),
    ],
)
def test_reward_fn_errors_are_clear(reward_module, spec, message):
    with pytest.raises(ValueError, match=message):
        load_reward_fn(spec.format(mod=reward_module))


def test_reward_fn_import_error_is_attached(tmp_path, monkeypatch):
    (tmp_path / "broken_rewards.py").write_text("import not_a_real_package_abc\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="not_a_real_package_abc") as err:
        load_reward_fn("broken_rewards:f")
    assert isinstance(err.value.__cause__, ImportError)


def test_jsonl_file_errors(tmp_path, reward_module):
    with pytest.raises(FileNotFoundError, match="existing JSONL file"):
        JsonlTask(tmp_path / "missing.jsonl", f"{reward_module}:contains")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{"text": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2 must be an object with a string 'prompt'"):
        JsonlTask(bad, f"{reward_module}:contains")
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1 must be one JSON object per line"):
        JsonlTask(bad, f"{reward_module}:contains")


def test_reward_must_return_a_number(jsonl):
    task = JsonlTask(jsonl, lambda prompt, completion: "high")
    with pytest.raises(TypeError, match="must return a number: got 'high'"):
        task.reward("ab", "ba", True)

"""The built-in coding environment (``phalanx.rl.agentic.code_env``) on the real
bubblewrap sandbox: an answer's code is tested, a right one ends the episode, a wrong
one gets the count and the reason back, a tool call runs ``run_python``, and the
rubric scores the last answer."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from phalanx.rl.agentic.code_env import answer_code, load_environment
from phalanx.rl.sandbox.tools import default_sandbox

try:
    default_sandbox()
except Exception as e:  # the machine cannot sandbox: nothing here can run
    pytest.skip(f"no sandbox here: {e}", allow_module_level=True)


def answer(text: str) -> list[dict[str, Any]]:
    return [{"role": "assistant", "content": text}]


def state_for(env: Any, row: int = 0) -> dict[str, Any]:
    r = env.get_dataset()[row]
    return {"answer": r["answer"], "trajectory": [], "prompt": r["prompt"]}


def test_answers_are_tested_and_fixes_asked_for():
    env = load_environment()
    st = state_for(env)  # add(a, b)
    wrong = asyncio.run(env.env_response(answer("def add(a, b):\n    return a - b"), st))
    assert wrong[0]["role"] == "user" and wrong[0]["content"].startswith("0/2 tests passed")
    assert st.get("final_env_response") is None
    crash = asyncio.run(env.env_response(answer("def add(a, b):\n    while True: pass"), st))
    assert "0/2 tests passed (timeout" in crash[0]["content"]
    right = "```python\ndef add(a, b):\n    return a + b\n```"
    assert asyncio.run(env.env_response(answer(right), st)) == []
    assert st["final_env_response"] == []  # all pass: the episode ends


def test_a_tool_call_runs_in_the_sandbox_and_the_rubric_scores_the_last_answer():
    env = load_environment()
    call = {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c0",
                "type": "function",
                "function": {"name": "run_python", "arguments": '{"code": "print(6 * 7)"}'},
            }
        ],
    }
    (out,) = asyncio.run(env.env_response([call], state_for(env)))
    assert out["role"] == "tool" and "42" in out["content"]
    funcs = [f for r in getattr(env.rubric, "rubrics", [env.rubric]) for f in r.funcs]
    (tests_passed,) = [f for f in funcs if f.__name__ == "tests_passed"]
    tests = state_for(env, 1)["answer"]  # double(x)
    scores = [
        asyncio.run(tests_passed([call, *answer(code)], tests, {}))
        for code in ("def double(x):\n    return x * 2", "def double(x):\n    return 0", "hi")
    ]
    assert scores == [1.0, 0.5, 0.0]  # (double(0) == 0 passes)


def test_the_code_of_an_answer_is_its_last_fenced_block():
    assert answer_code("x\n```python\na = 1\n```\n```\nb = 2\n```") == "b = 2\n"
    assert answer_code("def f(): pass") == "def f(): pass"

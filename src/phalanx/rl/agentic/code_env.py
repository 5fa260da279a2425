"""A built-in coding environment: write a function, run its tests, fix it.

``rl.env.module = "phalanx.rl.agentic.code_env"`` (``examples/agentic_code.toml``).
A ``verifiers`` ``ToolEnv``:

- the prompt asks for one Python function (:data:`PROBLEMS`: small ones, each
  with a few ``assert`` tests the model does not see);
- the model may call ``run_python`` (the code runs in the sandbox:
  :mod:`phalanx.rl.sandbox`) to try things;
- a turn with no tool call is an answer: its code (the last fenced block, or
  the whole text) runs against the tests in the sandbox. All pass: the episode
  ends. Otherwise the environment says how many passed and why the others
  failed (a timeout, the memory limit, an exception), and the model tries
  again, up to ``max_turns`` turns;
- the reward is the fraction of tests the last answer passes (0 for a
  refusal: a hang, a crash, no code).

A model built from config with random weights scores near zero here: it does
not write Python. The environment is for showing the pipeline (episodes,
tools, the sandbox, replicas lost mid-episode) and for models that code.
"""

from __future__ import annotations

import re
from typing import Any

PROBLEMS: list[tuple[str, str, str]] = [
    ("add", "add(a, b) that returns a + b", "assert add(1, 2) == 3\nassert add(-4, 4) == 0"),
    ("double", "double(x) that returns twice x", "assert double(3) == 6\nassert double(0) == 0"),
    ("first", "first(xs) that returns the first item of a list", "assert first([7, 1]) == 7"),
    ("last", "last(xs) that returns the last item of a list", "assert last([7, 1]) == 1"),
    (
        "biggest",
        "biggest(xs) that returns the largest number in a list",
        "assert biggest([3, 9, 2]) == 9\nassert biggest([-1]) == -1",
    ),
    (
        "rev",
        "rev(s) that returns the string s reversed",
        "assert rev('abc') == 'cba'\nassert rev('') == ''",
    ),
    (
        "is_even",
        "is_even(n) that returns True when n is even",
        "assert is_even(4)\nassert not is_even(7)",
    ),
    ("square", "square(n) that returns n * n", "assert square(5) == 25\nassert square(-2) == 4"),
    (
        "count_a",
        "count_a(s) that counts the letters 'a' in s",
        "assert count_a('banana') == 3\nassert count_a('xyz') == 0",
    ),
    (
        "total",
        "total(xs) that returns the sum of a list of numbers",
        "assert total([1, 2, 3]) == 6\nassert total([]) == 0",
    ),
    ("fact", "fact(n) that returns n factorial", "assert fact(0) == 1\nassert fact(5) == 120"),
    ("upper", "upper(s) that returns s in capital letters", "assert upper('ab') == 'AB'"),
    (
        "is_pal",
        "is_pal(s) that returns True when s reads the same backwards",
        "assert is_pal('abba')\nassert not is_pal('ab')",
    ),
    (
        "evens",
        "evens(xs) that keeps the even numbers of a list",
        "assert evens([1, 2, 3, 4]) == [2, 4]\nassert evens([]) == []",
    ),
    (
        "fib",
        "fib(n) that returns the n-th Fibonacci number (fib(0) = 0, fib(1) = 1)",
        "assert fib(1) == 1\nassert fib(10) == 55",
    ),
    (
        "words",
        "words(s) that returns the number of words in s",
        "assert words('a b c') == 3\nassert words('') == 0",
    ),
]
"""(function name, what it must do, its tests)."""

SYSTEM = (
    "You write Python. You may call run_python to run code. When you are done, answer with "
    "the function in a ```python block; it is then tested."
)
FENCE = re.compile(r"```(?:python)?\n(.*?)```", re.DOTALL)


def answer_code(text: str) -> str:
    """The code of an answer: its last fenced block, or the whole text."""
    blocks = FENCE.findall(text or "")
    return blocks[-1] if blocks else (text or "")


def load_environment(max_turns: int = 3, repeat: int = 1, **kwargs: Any) -> Any:
    """The environment: :data:`PROBLEMS` (``repeat`` times over) as its dataset."""
    import verifiers as vf
    from datasets import Dataset

    from phalanx.rl.sandbox.tools import default_sandbox, run_python, unit_test_score

    default_sandbox()  # SandboxUnavailable now, in one line, not at the first tool call
    rows = [
        {"question": f"Write a Python function {what}.", "answer": tests, "info": {"name": name}}
        for _ in range(max(1, repeat))
        for name, what, tests in PROBLEMS
    ]

    class CodeFixEnv(vf.ToolEnv):
        """ToolEnv whose answers (turns with no tool call) are tested, with feedback."""

        @vf.stop
        async def no_tools_called(self, state: vf.State) -> bool:  # type: ignore[override]
            return False  # an answer gets feedback; the episode ends when its tests pass

        async def env_response(self, messages: Any, state: Any, **kw: Any) -> Any:
            last = messages[-1]
            if last.get("tool_calls"):
                return await super().env_response(messages, state, **kw)
            score = unit_test_score(answer_code(str(last.get("content") or "")), state["answer"])
            if score.score >= 1.0:
                state["final_env_response"] = []
                return []
            return [
                {
                    "role": "user",
                    "content": f"{score.passed}/{score.total} tests passed ({score.reason}"
                    f"{': ' + score.detail[:300] if score.detail else ''}). "
                    f"Fix the function.",
                }
            ]

    async def tests_passed(completion: Any, answer: str, state: Any) -> float:
        """The fraction of the tests the last answer passes."""
        answers = [
            m for m in completion if m.get("role") == "assistant" and not m.get("tool_calls")
        ]
        if not answers:
            return 0.0
        return unit_test_score(answer_code(str(answers[-1].get("content") or "")), answer).score

    return CodeFixEnv(
        dataset=Dataset.from_list(rows),
        system_prompt=SYSTEM,
        tools=[run_python],
        max_turns=max_turns,
        rubric=vf.Rubric(funcs=[tests_passed]),
        **kwargs,
    )

"""What an RL environment calls: plain functions over one default sandbox.

- :func:`run_python` is a tool in the verifiers sense: its signature and docstring
  (``Args:``) become the OpenAI tool schema the model sees, and it returns text.
- :func:`unit_test_score` is a reward: the model's code, then unit tests, in the
  same sandbox; a :class:`TestScore`.

Neither raises for anything the code does: a timeout, a memory hog, a syntax error
or a network refusal is text (the tool) or a score of 0 with the reason (the
reward). The default sandbox is a :class:`~.bwrap.BwrapSandbox` built on first use
with the limits given to :func:`configure` (``SandboxLimits()`` by default); only
building it can raise (:class:`~.base.SandboxUnavailable`, one line), so an
environment should call :func:`default_sandbox` when it starts to fail fast.
"""

from __future__ import annotations

import ast
import json
import secrets
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.rl.sandbox.base import Reason, RunResult, Sandbox, SandboxLimits

RUNNER = Path(__file__).with_name("unit_runner.py")
STAGES = ("solution", "tests", "done")
"""Where the runner stopped: the solution raised, a test's setup raised, or all ran."""
TAIL_LINES = 8
"""How many last lines of stderr a failed run's text shows (the end of a traceback)."""

_lock = threading.Lock()
_limits = SandboxLimits()
_sandbox: Sandbox | None = None


def configure(limits: SandboxLimits | None = None, *, sandbox: Sandbox | None = None) -> None:
    """Use ``limits`` (a new default sandbox is built on next use), or ``sandbox``
    itself, for the tool functions from now on. Call it once when the environment
    is built, e.g. with the limits of the job's ``[rl.env]`` section."""
    global _limits, _sandbox
    with _lock:
        _limits = limits or (sandbox.limits if sandbox else SandboxLimits())
        _sandbox = sandbox


def default_sandbox() -> Sandbox:
    """The sandbox the tool functions use, built on first call. Raises
    :class:`~.base.SandboxUnavailable` (one line) when this machine cannot sandbox."""
    global _sandbox
    with _lock:
        if _sandbox is None:
            from phalanx.rl.sandbox.bwrap import BwrapSandbox

            _sandbox = BwrapSandbox(_limits)
        return _sandbox


def describe(result: RunResult, limits: SandboxLimits) -> str:
    """A short text of a run for the model: its stdout, then what went wrong."""
    parts = [result.stdout.rstrip("\n")] if result.stdout.strip() else []
    tail = "\n".join(result.stderr.rstrip("\n").splitlines()[-TAIL_LINES:])
    if result.reason == "ok":
        parts += [tail] if tail else []
    elif result.reason == "timeout":
        parts.append(f"timed out after {limits.time_s:g} s")
    elif result.reason == "memory":
        parts.append(f"killed: over the {limits.memory_mb} MB memory limit")
    elif result.reason == "output":
        parts.append(f"killed: more than {limits.max_output_bytes} bytes of output")
    else:
        parts.append(f"exit code {result.exit_code}" + (f": {tail}" if tail else ""))
    return "\n".join(parts) if parts else "(no output)"


def run_python(code: str) -> str:
    """Run a Python program in a sandbox and return what it printed.

    The program runs with the standard library only, no network, a private
    working directory and limits on time and memory. Print what you want to see.

    Args:
        code: The complete Python program to run.

    Returns:
        Its standard output, then its errors or why it was stopped.
    """
    sandbox = default_sandbox()
    return describe(sandbox.run(code), sandbox.limits)


@dataclass(frozen=True)
class TestScore:
    """The verdict of :func:`unit_test_score`. ``reason`` is ``ok`` when the tests ran
    (some may have failed: ``detail`` names them), else why the run was refused, and
    then ``passed`` is 0."""

    __test__ = False  # not a pytest class

    passed: int
    total: int
    reason: Reason
    detail: str = ""

    @property
    def score(self) -> float:
        """The fraction of tests passed, in [0, 1]."""
        return self.passed / self.total if self.total else 0.0


def count_tests(tests: str) -> int:
    """How many tests ``tests`` holds (top-level ``assert`` statements and ``def test_*``
    functions). ValueError in one line when it does not parse or holds none."""
    try:
        tree = ast.parse(tests, "tests.py")
    except SyntaxError as e:
        raise ValueError(
            f"unit tests must be valid Python: line {e.lineno}: {e.msg}. Fix the task's tests."
        ) from e
    n = sum(
        isinstance(node, ast.Assert)
        or (isinstance(node, ast.FunctionDef) and node.name.startswith("test_"))
        for node in tree.body
    )
    if n == 0:
        raise ValueError(
            "unit tests must hold at least one top-level assert or def test_*(): got none. "
            "Fix the task's tests."
        )
    return n


def unit_test_score(code: str, tests: str, sandbox: Sandbox | None = None) -> TestScore:
    """Run ``code`` and then ``tests`` (see :mod:`.unit_runner` for the convention)
    in one sandbox run; the passed fraction. Any refusal (the code fails to import,
    times out, runs out of memory, floods output) scores 0 with its reason.

    Raises ValueError (one line) only when ``tests`` is not valid or holds no test:
    that is the task's fault, not the model's.
    """
    total = count_tests(tests)
    sandbox = sandbox or default_sandbox()
    nonce = secrets.token_hex(16)
    result = sandbox.run(
        RUNNER.read_text(),
        stdin=nonce + "\n",
        files={"solution.py": code, "tests.py": tests},
    )
    if result.reason != "ok":
        return TestScore(0, total, result.reason, describe(result, sandbox.limits))
    verdict = _verdict(result.stderr, nonce)
    if verdict is None:  # the code ended the process before the runner could report
        text = describe(result, sandbox.limits)
        return TestScore(0, total, "error", f"the tests did not report: {text}")
    if verdict["stage"] == "solution":
        reason: Reason = "memory" if verdict["error_type"] == "MemoryError" else "error"
        return TestScore(0, total, reason, f"the code failed before the tests: {verdict['error']}")
    passed = max(0, min(int(verdict["passed"]), total))
    detail = "; ".join(str(f) for f in verdict.get("failures", []))
    if verdict["stage"] == "tests":
        detail = f"test setup failed: {verdict['error']}" + (f"; {detail}" if detail else "")
    return TestScore(passed, total, "ok", detail)


def _verdict(stderr: str, nonce: str) -> dict[str, Any] | None:
    """The runner's last verdict line in ``stderr``, or None when there is none (or it
    is not a well-formed verdict)."""
    for line in reversed(stderr.splitlines()):
        if line.startswith(nonce + " "):
            try:
                verdict = json.loads(line[len(nonce) + 1 :])
            except ValueError:
                return None
            ok = isinstance(verdict, dict) and verdict.get("stage") in STAGES
            return verdict if ok and isinstance(verdict.get("passed"), int) else None
    return None

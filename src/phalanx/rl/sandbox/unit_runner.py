"""The script :func:`phalanx.rl.sandbox.tools.unit_test_score` runs in the sandbox (as
its ``main.py``; it imports nothing of phalanx, the sandbox has only the standard
library).

It reads a nonce from stdin, runs ``solution.py`` (the model's code) in a namespace of
its own, then ``tests.py`` in that same namespace: each top-level ``assert`` is a
test, run where it stands; any other top-level statement (an import, a helper) is
setup, and if it raises the remaining tests are not run; then each top-level
``def test_*()`` is called with no arguments, in file order. A test passes when it
returns without raising.

The verdict is one line on a duplicate of stderr taken before the solution ran:
``<nonce> <json>``, after which the process ends with ``os._exit`` (no atexit hook of
the solution runs after it). The host takes the last line that starts with the nonce.
This keeps the verdict apart from anything the code prints and from ordinary bugs; it
is not a boundary against code written to forge it (that code shares this
interpreter), which is what the sandbox around it is for.
"""

from __future__ import annotations

import ast
import json
import os
import sys
from typing import Any


def _describe(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}".strip()
    return text if len(text) <= 300 else text[:300] + "..."


def main() -> None:
    nonce = sys.stdin.readline().strip()
    verdict_fd = os.dup(2)

    def report(**kw: Any) -> None:
        os.write(verdict_fd, f"\n{nonce} {json.dumps(kw)}\n".encode())
        os._exit(0)

    ns: dict[str, Any] = {"__name__": "solution", "__builtins__": __builtins__}
    try:
        with open("solution.py", encoding="utf-8") as f:
            exec(compile(f.read(), "solution.py", "exec"), ns)
    except BaseException as e:  # SystemExit too: the solution ended the run early
        report(stage="solution", passed=0, error=_describe(e), error_type=type(e).__name__)
    with open("tests.py", encoding="utf-8") as f:
        tree = ast.parse(f.read(), "tests.py")
    passed = 0
    failures: list[str] = []
    for node in tree.body:
        is_test = isinstance(node, ast.Assert)
        try:
            exec(compile(ast.Module(body=[node], type_ignores=[]), "tests.py", "exec"), ns)
        except BaseException as e:
            if not is_test:
                report(stage="tests", passed=passed, error=_describe(e), failures=failures[:10])
            failures.append(f"line {node.lineno} `{ast.unparse(node)[:200]}`: {_describe(e)}")
        else:
            passed += is_test
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            try:
                ns[node.name]()
            except BaseException as e:
                failures.append(f"{node.name}: {_describe(e)}")
            else:
                passed += 1
    report(stage="done", passed=passed, failures=failures[:10])


if __name__ == "__main__":
    main()

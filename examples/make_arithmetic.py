"""Write a synthetic set of arithmetic word problems as JSONL, for a math GRPO job
that runs offline (``task.name = "dataset"``, ``task.prompt_field = "question"``).

    python examples/make_arithmetic.py OUT.jsonl [--n 2000] [--seed 0] [--max 20]

Each row is ``{"question": ..., "answer": ..., "op": ...}``: one addition,
subtraction or multiplication of two numbers up to ``--max``, told as a short
story ("Ana has 7 pears and buys 5 more. How many pears does Ana have now?"),
ending with the instruction to put the answer after ``####``. The answer is
the number as text; the ``math`` reward checks it with math-verify. The same
``--seed`` writes the same file.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

NAMES = ["Ana", "Ben", "Chen", "Dana", "Eli", "Fatima", "Goran", "Hana", "Ivo", "Jun"]
THINGS = ["apples", "pears", "books", "coins", "stamps", "marbles", "pens", "shells"]
SUFFIX = " Give the final answer after ####."


def problem(rng: random.Random, top: int) -> dict[str, str]:
    who, what = rng.choice(NAMES), rng.choice(THINGS)
    a, b = rng.randint(1, top), rng.randint(1, top)
    op = rng.choice(["add", "sub", "mul"])
    if op == "add":
        text = f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have now?"
        answer = a + b
    elif op == "sub":
        a, b = max(a, b), min(a, b)
        text = f"{who} has {a} {what} and gives away {b}. How many {what} are left?"
        answer = a - b
    else:
        text = f"{who} fills {a} boxes with {b} {what} each. How many {what} is that in all?"
        answer = a * b
    return {"question": text + SUFFIX, "answer": str(answer), "op": op}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max", type=int, default=20, help="largest operand")
    a = ap.parse_args()
    if a.n < 1 or a.max < 1:
        print(f"make_arithmetic: --n and --max must be >= 1: got --n {a.n}, --max {a.max}.")
        return 2
    rng = random.Random(a.seed)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    with a.out.open("w") as f:
        for _ in range(a.n):
            f.write(json.dumps(problem(rng, a.max)) + "\n")
    print(f"wrote {a.n} problems to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Sandbox overhead benchmark (issue 38): what one tool call costs in the bubblewrap
sandbox against the same code in a plain subprocess.

    python bench/agentic_sandbox.py [--json] [--n 200]

Figures (both arms measured in the same run, interleaved call by call, so a busy
machine slows both alike):

- ``sandbox_p50_ms`` / ``sandbox_p99_ms``: wall time of one
  :meth:`~phalanx.rl.sandbox.bwrap.BwrapSandbox.run` of ``print(sum(range(1000)))``
  under the default limits, from the call to its result (work directory made and
  removed, bwrap's namespaces, setpriv and prlimit when run by root, the
  interpreter's start, output read);
- ``plain_p50_ms`` / ``plain_p99_ms``: ``subprocess.run([python, "-I", "-c", code])``
  of the same code with the same interpreter, output captured;
- ``sandbox_overhead_ms``: sandbox p50 minus plain p50; ``sandbox_ratio``: their
  quotient.

``bench/agentic.py`` imports :func:`sandbox_overhead`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from typing import Any

CODE = "print(sum(range(1000)))"
WARMUP = 5


def _pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else xs[0]


def sandbox_overhead(n: int = 200) -> dict[str, Any]:
    """p50/p99 ms of ``n`` sandboxed calls and ``n`` plain ones, interleaved."""
    from phalanx.rl.sandbox.bwrap import BwrapSandbox

    box = BwrapSandbox()
    boxed: list[float] = []
    plain: list[float] = []
    want = str(sum(range(1000)))
    for i in range(n + WARMUP):
        t = time.perf_counter()
        r = box.run(CODE)
        dt_box = (time.perf_counter() - t) * 1e3
        t = time.perf_counter()
        p = subprocess.run([box.python, "-I", "-c", CODE], capture_output=True, text=True)
        dt_plain = (time.perf_counter() - t) * 1e3
        if r.stdout.strip() != want or p.stdout.strip() != want:
            raise RuntimeError(f"a call printed the wrong thing: {r!r} / {p.stdout!r}")
        if i >= WARMUP:
            boxed.append(dt_box)
            plain.append(dt_plain)
    out = {
        "n": n,
        "sandbox_p50_ms": _pct(boxed, 50),
        "sandbox_p99_ms": _pct(boxed, 99),
        "plain_p50_ms": _pct(plain, 50),
        "plain_p99_ms": _pct(plain, 99),
    }
    out["sandbox_overhead_ms"] = out["sandbox_p50_ms"] - out["plain_p50_ms"]
    out["sandbox_ratio"] = out["sandbox_p50_ms"] / out["plain_p50_ms"]
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--n", type=int, default=200, help="calls per arm")
    a = p.parse_args()
    r = sandbox_overhead(a.n)
    if a.json:
        print(json.dumps(r), flush=True)
        return
    for k, v in r.items():
        print(f"{k:>22}: {v}")


if __name__ == "__main__":
    main()

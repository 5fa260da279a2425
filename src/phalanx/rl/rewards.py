"""Reward functions of dataset tasks: built-ins by name, user functions by
``module:function``, combined with weights, each call bounded in time.

Built-ins (``task.rewards``):

- ``math``: 1.0 when the completion's final answer equals the row's answer as
  `math-verify <https://github.com/huggingface/Math-Verify>`_ decides (LaTeX,
  fractions, percentages, sets, equations: ``\\frac{1}{2}``, ``0.5`` and
  ``1/2`` agree), else 0.0. It is also the task's exact match.
- ``format``: 1.0 when the completion ends with its final answer in the form
  ``task.format_pattern`` matches (default: ``\\boxed{...}`` or ``#### ...``
  on the last line) and EOS came (it was not cut off), else 0.0.

A user function is called as ``fn(prompt, completion, **extra)``; ``extra``
holds ``finished``, ``answer`` and the row's other fields, passed only when
its signature names them or takes ``**kwargs``.

A function that raises, returns something other than a number, or runs past
``task.reward_timeout_s`` raises :class:`RewardError`: the rollout replica
submits that prompt's rollout as discarded, with the reason, and goes on; the
ledger retires the prompt.
The time bound is a ``SIGALRM`` timer, so it holds where rewards are scored
(the replica's main thread); elsewhere calls are not bounded.
"""

from __future__ import annotations

import importlib
import inspect
import re
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from phalanx.config.rl import FORMAT_PATTERN

BUILTIN = ("math", "format")


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


def accepted_kwargs(fn: RewardFn) -> Callable[[dict[str, Any]], dict[str, Any]]:
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


class RewardError(Exception):
    """A reward function failed on one completion: the reason, in one line."""


def math_reward(prompt: str, completion: str, answer: Any = None, **_: Any) -> float:
    """1.0 when math-verify finds the completion's final answer equal to ``answer``."""
    if answer is None:
        return 0.0
    from math_verify import parse, verify

    # Our own timer bounds the call (math-verify's would replace it with its own).
    gold = parse(_as_math(str(answer)), parsing_timeout=None)  # type: ignore[arg-type]
    pred = parse(completion, parsing_timeout=None)  # type: ignore[arg-type]
    return float(bool(gold) and bool(pred) and verify(gold, pred, timeout_seconds=None))


def _as_math(answer: str) -> str:
    """A bare answer (``42``, ``1/2``) as math-verify reads a gold answer best: in $...$."""
    s = answer.strip()
    return s if "$" in s or "\\boxed" in s else f"${s}$"


def format_reward(pattern: str) -> RewardFn:
    rx = re.compile(pattern)

    def reward(prompt: str, completion: str, finished: bool = True, **_: Any) -> float:
        return float(finished and rx.search(completion.strip()) is not None)

    return reward


class Rewards:
    """The weighted sum of a task's reward functions."""

    def __init__(
        self,
        specs: Sequence[str],
        weights: Sequence[float] | None = None,
        *,
        format_pattern: str = FORMAT_PATTERN,
        timeout_s: float = 5.0,
    ):
        if not specs:
            raise ValueError(
                "task.rewards must name at least one reward function: got none. Use "
                f"built-ins {list(BUILTIN)} or module:function."
            )
        weights = list(weights) if weights else [1.0] * len(specs)
        if len(weights) != len(specs):
            raise ValueError(
                f"task.reward_weights must have one weight per reward: got {len(weights)} "
                f"weights for {len(specs)} rewards {list(specs)}."
            )
        self.names = list(specs)
        self.weights = weights
        self.timeout_s = timeout_s
        self.fns: list[tuple[RewardFn, Callable[[dict[str, Any]], dict[str, Any]]]] = []
        for spec in specs:
            fn = _builtin(spec, format_pattern) if ":" not in spec else load_reward_fn(spec)
            self.fns.append((fn, accepted_kwargs(fn)))

    def __call__(self, prompt: str, completion: str, extra: dict[str, Any]) -> float:
        return self.parts(prompt, completion, extra)[0]

    def parts(
        self, prompt: str, completion: str, extra: dict[str, Any]
    ) -> tuple[float, dict[str, float]]:
        """(weighted sum, each function's own value by name)."""
        values = {}
        for name, (fn, keep) in zip(self.names, self.fns, strict=True):
            values[name] = self._one(name, fn, prompt, completion, keep(extra))
        total = sum(w * values[n] for n, w in zip(self.names, self.weights, strict=True))
        return total, values

    def _one(self, name: str, fn: RewardFn, prompt: str, completion: str, kw: dict) -> float:
        try:
            with time_limit(self.timeout_s):
                value = fn(prompt, completion, **kw)
        except _Timeout:
            raise RewardError(f"reward {name} timed out after {self.timeout_s} s") from None
        except Exception as e:
            raise RewardError(f"reward {name} raised {type(e).__name__}: {str(e)[:200]}") from e
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise RewardError(f"reward {name} must return a number: got {value!r:.80}")
        return float(value)


def _builtin(name: str, format_pattern: str) -> RewardFn:
    if name == "math":
        return math_reward
    if name == "format":
        return format_reward(format_pattern)
    raise ValueError(
        f"task.rewards entries must be a built-in reward {list(BUILTIN)} or "
        f"'package.module:function': got {name!r}."
    )


class _Timeout(BaseException):
    """Raised inside a reward call by the timer (not an Exception: a reward's own
    ``except Exception`` does not swallow it)."""


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise :class:`_Timeout` in the block after ``seconds`` (main thread only; a
    no-op elsewhere or for ``seconds <= 0``)."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum: int, frame: Any) -> None:
        raise _Timeout

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)

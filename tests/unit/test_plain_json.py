"""The controller's check of free-form JSON payloads (``controller/app.py``): finite
numbers, valid Unicode and bounded nesting, with lists of numbers checked in one pass."""

from __future__ import annotations

import pytest

from phalanx.protocol.base import MAX_PAYLOAD_DEPTH
from phalanx.protocol.base import check_plain_json as _check_plain_json


def nested(depth: int, leaf: object) -> object:
    v = leaf
    for _ in range(depth):
        v = [v]
    return v


@pytest.mark.parametrize(
    "bad",
    [
        [0.5, float("nan")],
        [1, "x", float("inf")],
        [[1.0], [float("-inf")]],
        [10**400, float("inf")],  # an int too large for a float: walked one by one
        {"k": [1.0, {"deep": float("nan")}]},
    ],
)
def test_non_finite_numbers_are_refused_wherever_they_are(bad: object):
    with pytest.raises(ValueError, match="finite numbers only"):
        _check_plain_json({"rollout_id": "a", "v": bad})


def test_plain_values_pass_unchanged():
    ok = {"ids": list(range(512)), "lp": [-0.5] * 512, "mixed": [10**400, 1.0, "x", True, None]}
    assert _check_plain_json(ok) is ok


def test_lone_surrogates_and_deep_nesting_are_refused():
    with pytest.raises(ValueError, match="valid Unicode"):
        _check_plain_json({"t": ["ok", "\ud800"]})
    _check_plain_json(nested(MAX_PAYLOAD_DEPTH, 1.0))
    with pytest.raises(ValueError, match="nest at most"):  # numbers count as a level too
        _check_plain_json(nested(MAX_PAYLOAD_DEPTH + 1, 1.0))

"""bench/ops.py's assembly of its parts: each part's flags on one parser, a part that
is absent skipped in one line, the parts' figures merged (a figure given twice
refused), and a part that fails reported while the others still count. The parts here
are small modules written to a temporary directory with the parts' interface
(``add_args``, ``measure``); no job runs."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("ops", ROOT / "bench" / "ops.py")
assert _spec is not None and _spec.loader is not None
ops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ops)

PART = """
def add_args(p):
    p.add_argument("--{flag}", type=float, default=1.0)

def measure(args):
    if args.{attr} < 0:
        raise RuntimeError("the {name} run failed\\nits last line")
    return {{"{key}": args.{attr} * 2, "{name}_runs": 1}}
"""


@pytest.fixture
def parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Two parts, ``ops_t_a`` and ``ops_t_b``, importable by name."""
    for name, flag, key in (("ops_t_a", "a-s", "a_figure"), ("ops_t_b", "b-ratio", "b_figure")):
        attr = flag.replace("-", "_")
        (tmp_path / f"{name}.py").write_text(PART.format(flag=flag, attr=attr, key=key, name=name))
    (tmp_path / "ops_t_bare.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("ops_t_a", "ops_t_b", "ops_t_bare"):
        sys.modules.pop(name, None)


def test_each_parts_flags_go_on_one_parser_and_absent_parts_are_skipped(parts):
    found, skipped = ops.load_parts(("ops_t_a", "ops_t_missing", "ops_t_b", "ops_t_bare"))
    assert list(found) == ["ops_t_a", "ops_t_b"]
    assert skipped == {
        "ops_t_missing": "bench/ops_t_missing.py is not in this checkout",
        "ops_t_bare": "bench/ops_t_bare.py has no add_args or measure()",
    }
    a = ops.parser(found).parse_args(["--json", "--a-s", "3", "--b-ratio", "0.5"])
    assert (a.json, a.a_s, a.b_ratio) == (True, 3.0, 0.5)
    out = ops.run(a, found, ["ops_t_a", "ops_t_b"])
    assert out["a_figure"] == 6.0 and out["b_figure"] == 1.0 and out["errors"] == {}
    assert set(out["part_wall_s"]) == {"ops_t_a", "ops_t_b"}


def test_a_failing_part_is_one_line_and_the_others_still_count(parts):
    found, _ = ops.load_parts(("ops_t_a", "ops_t_b"))
    a = ops.parser(found).parse_args(["--a-s", "-1"])
    out = ops.run(a, found, list(found))
    assert out["errors"] == {"ops_t_a": "its last line"} and out["b_figure"] == 2.0
    assert "a_figure" not in out


def test_a_figure_given_by_two_parts_is_refused():
    assert ops.merge({"x": {"k": 1}, "y": {"j": 2.5}}) == {"k": 1, "j": 2.5}
    with pytest.raises(ValueError, match="figure 'k' is given by both x and y"):
        ops.merge({"x": {"k": 1}, "y": {"k": 2}})


def test_only_chooses_parts_and_names_a_bad_one(parts):
    found, _ = ops.load_parts(("ops_t_a", "ops_t_b"))
    assert ops.chosen(None, found) == ["ops_t_a", "ops_t_b"]
    assert ops.chosen("ops_soak", found) == []  # a part, but not among those found here
    with pytest.raises(SystemExit, match="--only names no part ops_t_zz"):
        ops.chosen("ops_t_zz", found)


def test_the_real_parts_here_load_with_the_figures_issue_40_asks():
    found, skipped = ops.load_parts()
    assert set(found) | set(skipped) == set(ops.PARTS) and "ops_soak" in found
    a = ops.parser(found).parse_args(["--soak-s", "60", "--soak-every", "10"])
    assert (a.soak_s, a.soak_every, a.calm_steps, a.json) == (60.0, 10.0, 300, False)
    assert ops.KEYS["ops_soak"] == ("soak_goodput",)


def test_a_part_that_leaves_out_its_figure_is_an_error(parts, monkeypatch: pytest.MonkeyPatch):
    found, _ = ops.load_parts(("ops_t_a",))
    monkeypatch.setitem(ops.KEYS, "ops_t_a", ("a_figure", "a_other"))
    out = ops.run(ops.parser(found).parse_args([]), found, ["ops_t_a"])
    assert out["errors"] == {"ops_t_a": "bench/ops_t_a.py gave no a_other"}
    assert out["a_figure"] == 2.0


def test_fault_costs_are_the_wall_time_less_the_calm_time_of_the_steps_between():
    from ops_soak import fault_costs

    # Calm: a step per 0.1 s. A stop at t=1 stalls 2 s; a kill at t=5 costs nothing.
    times = {i: 0.1 * i for i in range(1, 11)} | {i: 2.0 + 0.1 * i for i in range(11, 81)}
    faults = [{"t": 1.0, "kind": "stop"}, {"t": 5.0, "kind": "kill"}]
    costs = fault_costs(times, faults, 0.1)
    assert costs == {"kill": 0.0, "stop": 2.0}


def test_a_part_run_on_its_own_takes_only_its_flags_and_exits_by_its_verdict(parts, capsys):
    found, _ = ops.load_parts(("ops_t_a",))
    part = found["ops_t_a"]
    assert ops.part_main(part, ["--json", "--a-s", "2"]) == 0
    assert json.loads(capsys.readouterr().out) == {"a_figure": 4.0, "ops_t_a_runs": 1}
    assert ops.part_main(part, ["--a-s", "2"], ok=lambda out: out["a_figure"] > 5) == 1
    assert capsys.readouterr().out.splitlines()[0] == "                a_figure: 4.0"
    with pytest.raises(SystemExit):
        ops.part_main(part, ["--b-ratio", "1"])  # another part's flag


def test_the_soaks_overrides_go_to_both_runs_as_phalanx_run_flags_or_are_one_line():
    spec = importlib.util.spec_from_file_location("ops_soak_t", ROOT / "bench" / "ops_soak.py")
    assert spec is not None and spec.loader is not None
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    sets = ["timeouts.collective_s=1.0", "train.exact_reduction=true"]
    assert soak.overrides(sets) == (
        "--timeouts.collective_s=1.0",
        "--train.exact_reduction=true",
    )
    with pytest.raises(SystemExit, match=r"--soak-set takes SECTION\.KEY=VALUE") as e:
        soak.overrides(["collective_s=1", "timeouts.heartbeat_s"])
    assert "'collective_s=1', 'timeouts.heartbeat_s'" in str(e.value)

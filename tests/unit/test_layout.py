"""The package's layout keeps the promises of docs/architecture.md: modules stay
small, imports form no cycle, and nothing outside the controller reaches into
it (replicas and tools speak the protocol through the client)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "phalanx"
MAX_LINES = 450


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The phalanx modules ``name`` imports when it runs: at module level or in a
    function, but not under ``if TYPE_CHECKING``. ``from pkg import mod`` counts as
    importing ``pkg.mod`` when that is a module."""
    tree = ast.parse(path.read_text())
    out: set[str] = set()
    is_pkg = path.name == "__init__.py"
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and _type_checking(node):
            todo.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("phalanx")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name if is_pkg else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            if base.startswith("phalanx"):
                out.add(base)
                out |= {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known}
        todo.extend(ast.iter_child_nodes(node))
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    g = {name: imports(name, path, known) for name, path in mods.items()}
    # Importing a.b.c runs a/__init__ and a/b/__init__ first (but not for a module
    # inside that package: its own package is already being imported).
    for name in list(g):
        own = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        for dep in list(g[name]):
            parts = dep.split(".")
            g[name] |= {".".join(parts[:i]) for i in range(2, len(parts))} - own
    # The root package runs before any phalanx module and imports none at module
    # level (its Replica is a lazy attribute, test_the_root_package_is_lazy), so an
    # edge into it (``from phalanx import env``) cannot close a cycle.
    for deps in g.values():
        deps.discard("phalanx")
    return g


def test_the_root_package_is_lazy():
    tree = ast.parse((SRC / "phalanx" / "__init__.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert all(not (getattr(n, "module", None) or "").startswith("phalanx") for n in top)
    assert all(
        not a.name.startswith("phalanx") for n in top for a in n.names if isinstance(n, ast.Import)
    )


def test_no_module_is_over_the_size_limit():
    big = {
        name: n
        for name, path in modules().items()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert big == {}, f"modules over {MAX_LINES} lines: split them (STYLE.md)"


def test_imports_form_no_cycle():
    g = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(g[m]):
            if state.get(d) == 1:
                cycle = [*stack[stack.index(d) :], d]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m)


def test_only_the_controller_command_imports_the_controller():
    """Replicas, launchers and tools speak the protocol (phalanx.protocol) through
    phalanx.client; only ``phalanx controller`` (cli.py) starts one, through the
    package's own entry point."""
    g = graph()
    # cli_net: the commands' network flags, split out of cli.py (the controller
    # command's TLS and bind checks, through the package's entry point too).
    # audit.ledger: a finished run's ledger, rebuilt from its journal (ledger_balance).
    allowed = {
        "phalanx.cli": {"phalanx.controller"},
        "phalanx.cli_net": {"phalanx.controller"},
        "phalanx.audit.ledger": {"phalanx.controller"},
    }
    bad = {
        name: sorted(
            d
            for d in deps
            if d.startswith("phalanx.controller") and d not in allowed.get(name, set())
        )
        for name, deps in g.items()
        if not name.startswith("phalanx.controller")
    }
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_core_does_no_io():
    """The controller's core imports nothing that reads a clock, a disk or a socket,
    nor any layer around it."""
    forbidden = {"time", "os", "sqlite3", "socket", "asyncio", "uuid", "random", "httpx", "fastapi"}
    for name, path in modules().items():
        if not name.startswith("phalanx.controller.core"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                names = {(node.module or "").split(".")[0]}
                mod = node.module or ""
                outside = mod.startswith("phalanx.controller") and not mod.startswith(
                    "phalanx.controller.core"
                )
                assert not outside, f"{name} imports {mod}: the core is the innermost layer"
            else:
                continue
            assert not names & forbidden, f"{name} imports {names & forbidden}"


def test_no_module_reads_another_modules_private_names():
    for name, path in modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("phalanx"):
                private = [a.name for a in node.names if a.name.startswith("_")]
                assert not private, f"{name} imports private names {private} from {node.module}"


def test_every_job_kind_names_a_loop_with_run():
    import importlib

    from phalanx.jobs import JOBS

    for kind, spec in JOBS.items():
        mod = importlib.import_module(spec.module)
        assert callable(getattr(mod, "run", None)), f"{kind}: {spec.module} has no run()"
        assert spec.module == f"phalanx.jobs.{kind}"

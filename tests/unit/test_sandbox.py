"""The bubblewrap sandbox and its tools, on real bwrap: what runs, what is refused, and
that every refusal is a result (a reason, a score of 0, a text), never an exception
(issue 38)."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from phalanx.rl.sandbox import tools
from phalanx.rl.sandbox.base import SandboxLimits, SandboxUnavailable
from phalanx.rl.sandbox.bwrap import UID_BASE, UID_SPAN, BwrapSandbox

ROOT = Path(__file__).resolve().parents[2]


def _build(limits: SandboxLimits) -> BwrapSandbox:
    try:
        return BwrapSandbox(limits)
    except SandboxUnavailable as e:
        pytest.skip(f"no sandbox on this machine: {e}")


@pytest.fixture(scope="module")
def box() -> BwrapSandbox:
    """Generous limits: the code that should run, runs, on a busy machine."""
    return _build(SandboxLimits(time_s=20.0, memory_mb=256))


@pytest.fixture(scope="module")
def quick() -> BwrapSandbox:
    """A 1 s limit, for the runs that must be killed."""
    return _build(SandboxLimits(time_s=1.0, memory_mb=256))


@pytest.fixture
def tool_box(quick: BwrapSandbox) -> Iterator[BwrapSandbox]:
    tools.configure(sandbox=quick)
    yield quick
    tools.configure()


def _sandbox_processes() -> list[int]:
    """Pids of processes running as a sandbox uid (what a root-run sandbox uses)."""
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/status") as f:
                uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        except (OSError, ValueError, StopIteration):
            continue
        if UID_BASE <= uid < UID_BASE + UID_SPAN:
            out.append(int(d))
    return out


def test_code_runs_with_stdin_and_files(box: BwrapSandbox):
    code = "import sys\nprint(input().upper())\nprint(open('data/in.txt').read())\nimport helper\n"
    r = box.run(code, stdin="abc\n", files={"data/in.txt": "payload", "helper.py": "print(7)"})
    assert (r.reason, r.exit_code, r.ok) == ("ok", 0, True)
    assert r.stdout == "ABC\npayload\n7\n"
    r = box.run("import sys; print('bad', file=sys.stderr); sys.exit(3)")
    assert (r.reason, r.exit_code, r.stderr) == ("error", 3, "bad\n")


def test_network_is_refused(box: BwrapSandbox):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = f"""
import socket, urllib.request
for what, call in [
    ("host port", lambda: socket.create_connection(("127.0.0.1", {port}), timeout=5)),
    ("public ip", lambda: urllib.request.urlopen("http://1.1.1.1", timeout=5)),
    ("dns", lambda: socket.getaddrinfo("example.com", 80)),
]:
    try:
        call()
        print(what, "reached")
    except OSError as e:
        print(what, "refused", type(e).__name__)
"""
        r = box.run(code)
    assert r.reason == "ok", r.stderr
    assert r.stdout.splitlines() == [
        "host port refused ConnectionRefusedError",
        "public ip refused URLError",
        "dns refused gaierror",
    ]


@pytest.mark.parametrize("code", ["while True: pass", "import time; time.sleep(100)"])
def test_the_time_limit_kills(quick: BwrapSandbox, code: str):
    r = quick.run("print('started')\n" + code)
    assert (r.reason, r.exit_code, r.ok) == ("timeout", None, False)
    assert r.stdout == "started\n"  # unbuffered: what it printed before the kill is kept


def test_the_memory_limit(box: BwrapSandbox):
    r = box.run("x = bytearray(2 * 1024**3)")
    assert r.reason == "memory" and "MemoryError" in r.stderr


def test_writes_outside_the_work_dir_fail_and_nothing_persists(box: BwrapSandbox):
    host_tmp = tempfile.mkdtemp(prefix="phalanx-sandbox-test-")
    try:
        targets = ["/usr/x", "/etc/x", "/root/x", "/x", f"{host_tmp}/x", f"{ROOT}/x"]
        code = f"""
import os
for t in {targets!r}:
    try:
        open(t, "w").write("x")
        print(t, "written")
    except OSError as e:
        print(t, "refused")
print(os.path.exists({str(ROOT)!r}), os.path.exists({host_tmp!r}))
open("keep.txt", "w").write("x")
open("/tmp/keep.txt", "w").write("x")
"""
        r = box.run(code)
        assert r.reason == "ok", r.stderr
        assert r.stdout.splitlines() == [f"{t} refused" for t in targets] + ["False False"]
        assert os.listdir(host_tmp) == [] and not (ROOT / "x").exists()
        r = box.run("import os; print(os.listdir('.'), os.listdir('/tmp'))")
        assert r.stdout == "['main.py'] []\n"
    finally:
        os.rmdir(host_tmp)


FORKS = """
import os
n = 0
try:
    while True:
        if os.fork() == 0:
            import time
            time.sleep(30)
        n += 1
except OSError:
    print(n)
"""
"""Forks sleeping children until a fork fails, then prints how many it made."""


def test_a_fork_bomb_is_contained_and_leaves_nothing(quick: BwrapSandbox):
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    r = quick.run(bomb)
    assert r.reason in ("timeout", "error")
    assert _sandbox_processes() == []
    # The process limit, not the machine, stopped it: a fork past it fails inside.
    r = quick.run(FORKS)
    assert r.reason == "ok" and 0 < int(r.stdout) < quick.limits.max_processes
    assert _sandbox_processes() == []


def test_an_output_flood_is_cut(box: BwrapSandbox):
    r = box.run("while True: print('x' * 1000)")
    assert r.reason == "output"
    assert len(r.stdout) < box.limits.keep_bytes + 100 and "bytes cut" in r.stdout


TESTS = """
assert add(1, 2) == 3
assert add(-1, 1) == 0
def test_big():
    assert add(10**9, 1) == 10**9 + 1
"""


def test_unit_test_score(box: BwrapSandbox, quick: BwrapSandbox):
    right = tools.unit_test_score("def add(a, b):\n    return a + b\nprint('noise')", TESTS, box)
    assert (right.passed, right.total, right.score, right.reason) == (3, 3, 1.0, "ok")
    partial = tools.unit_test_score("def add(a, b):\n    return 3", TESTS, box)
    assert (partial.passed, partial.reason) == (1, "ok") and "add(-1, 1)" in partial.detail
    wrong = tools.unit_test_score("def add(a, b):\n    return None", TESTS, box)
    assert (wrong.score, wrong.reason) == (0.0, "ok")
    hang = tools.unit_test_score("def add(a, b):\n    while True: pass", TESTS, quick)
    assert (hang.score, hang.reason) == (0.0, "timeout")
    boom = tools.unit_test_score("raise ImportError('no')\ndef add(a, b): return a + b", TESTS, box)
    assert (boom.score, boom.reason) == (0.0, "error") and "ImportError: no" in boom.detail
    bad = tools.unit_test_score("def add(a b): pass", TESTS, box)
    assert (bad.score, bad.reason) == (0.0, "error") and "SyntaxError" in bad.detail
    hog = tools.unit_test_score("x = bytearray(2 * 1024**3)", TESTS, box)
    assert (hog.score, hog.reason) == (0.0, "memory")
    # Code that ends the process itself leaves no verdict: 0, not a crash.
    gone = tools.unit_test_score("import os; os._exit(0)", TESTS, box)
    assert (gone.score, gone.reason) == (0.0, "error")
    with pytest.raises(ValueError, match="at least one top-level assert"):
        tools.unit_test_score("", "x = 1", box)


def test_run_python_returns_text_for_every_refusal(tool_box: BwrapSandbox):
    assert tools.run_python("print(6 * 7)") == "42"
    assert tools.run_python("while True: pass") == "timed out after 1 s"
    assert tools.run_python("x = bytearray(2 * 1024**3)") == "killed: over the 256 MB memory limit"
    assert tools.run_python("1 / 0").startswith("exit code 1: Traceback")
    assert "ZeroDivisionError" in tools.run_python("1 / 0")
    net = tools.run_python("import socket; socket.create_connection(('1.1.1.1', 80))")
    assert "Network is unreachable" in net
    assert tools.run_python("") == "(no output)"


def test_a_missing_bwrap_is_one_line_naming_the_package():
    with pytest.raises(SandboxUnavailable) as e:
        BwrapSandbox(bwrap="/nonexistent/bwrap")
    msg = str(e.value)
    assert "\n" not in msg and "apt-get install bubblewrap" in msg


SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.mark.skipif(
    os.geteuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK),
    reason="needs root (to become another user) and a system /usr/bin/python3",
)
def test_run_by_a_user_it_takes_a_user_namespace_and_still_limits(box: BwrapSandbox):
    """The other path: a non-root host user gets bwrap's user namespace instead of
    setpriv, and RLIMIT_NPROC still binds (counted in that namespace). The host side
    runs as ``nobody`` with the system Python (ours lives under root's 0700 home)."""
    import subprocess

    script = (
        "from phalanx.rl.sandbox.bwrap import BwrapSandbox\n"
        "from phalanx.rl.sandbox.base import SandboxLimits\n"
        "s = BwrapSandbox(SandboxLimits(time_s=20.0))\n"
        "print(s.as_root, s.run('import os; print(os.getuid())').stdout.strip())\n"
        f"print(s.run({FORKS!r}).stdout.strip(), s.run('x = bytearray(2**31)').reason)\n"
    )
    # A copy of the package that `nobody` can read: the checkout may sit under a
    # directory only root enters (a CI clone in a mkdtemp directory, root's home).
    import shutil
    import tempfile

    readable = Path(tempfile.mkdtemp(prefix="phalanx-src-", dir="/tmp"))
    try:
        shutil.copytree(
            ROOT / "src" / "phalanx", readable / "phalanx", ignore=shutil.ignore_patterns("*.pyc")
        )
        for d, _, files in os.walk(readable):
            os.chmod(d, 0o755)
            for f in files:
                os.chmod(os.path.join(d, f), 0o644)
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(readable)}
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
        out = subprocess.run(
            [*cmd, SYSTEM_PYTHON, "-c", script], env=env, cwd="/", capture_output=True, text=True
        )
    finally:
        shutil.rmtree(readable, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.split()
    assert lines[:2] == ["False", "65534"]
    assert 0 < int(lines[2]) < box.limits.max_processes and lines[3] == "memory"

"""A sandbox built with bubblewrap (``bwrap``, Debian's ``bubblewrap`` package).

Each run gets:

- **namespaces** from bubblewrap: its own mount, pid, network, IPC and UTS namespaces
  (and cgroup where the kernel allows). The network namespace has only a loopback
  device on which nothing listens: no host port, no DNS, no internet.
- **a filesystem** of read-only binds: the system directories that exist here
  (``/usr``, and ``/bin``, ``/lib``... as the symlinks or directories they are),
  ``/etc/ld.so.cache``, and the interpreter's prefix (``sys.base_prefix`` by default:
  the standard library, not our virtualenv); a private ``/proc``, a minimal ``/dev``,
  a private size-capped tmpfs ``/tmp``, and ``/sandbox``, the work directory, bound
  read-write from a fresh host directory removed after the run. The root is
  read-only. Nothing else of the host (``/etc``, ``/root``, ``/home``, the repository,
  the host's temp dir) is visible.
- **a clean environment** (``--clearenv``; PATH, HOME=/sandbox, TMPDIR, LANG) and
  ``python -E -s -B -u main.py``: no ``PYTHON*`` variables, no user site, no
  bytecode written, unbuffered output (so a killed run still shows what it printed).
  Not ``-I``: that would also drop the script's directory from ``sys.path``, and
  the code may import the files it was given.
- **an unprivileged user**. Run by root, bubblewrap makes no user namespace and the
  code is started through util-linux's ``setpriv`` as a random uid in
  ``[UID_BASE, UID_BASE + UID_SPAN)``, with no capabilities and ``no_new_privs``.
  Run by anyone else, bubblewrap makes a user namespace (the host user inside).
  Either way the code's real uid is not root, which is what makes ``RLIMIT_NPROC``
  bite: the kernel never applies it to root. Per-run random uids (or per-run user
  namespaces) keep concurrent sandboxes from sharing one process count.
- **rlimits** set by util-linux's ``prlimit`` just before Python starts (so they
  apply inside the new user, and to everything the code forks): ``RLIMIT_AS``
  (``memory_mb``), ``RLIMIT_NPROC`` (``max_processes``), ``RLIMIT_NOFILE``,
  ``RLIMIT_FSIZE``, ``RLIMIT_CORE`` = 0, and ``RLIMIT_CPU`` = the wall limit + 1 s as
  a backstop.
- **the kill** of the host (:mod:`.process`): the wall-clock and output limits.

Memory is limited with ``RLIMIT_AS``, not a cgroup: this machine (and most
containers that run rollout replicas) has cgroup v1 or a cgroup v2 tree that is not
delegated to us, so a memory cgroup cannot be created per run. ``RLIMIT_AS`` needs
nothing from the host and makes an allocation over the limit fail in the allocating
process (Python raises ``MemoryError``), which classifies reliably from the
traceback, where a cgroup OOM kill would only show as a ``SIGKILL``. It bounds each
process, not their sum: ``max_processes`` x ``memory_mb`` bounds the whole sandbox.
"""

from __future__ import annotations

import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath

from phalanx.rl.sandbox.base import RunResult, Sandbox, SandboxLimits, SandboxUnavailable
from phalanx.rl.sandbox.process import run_limited

WORKDIR = "/sandbox"
"""The run's work directory inside the sandbox (its cwd and HOME)."""
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ETC_FILES = ("/etc/ld.so.cache",)
UID_BASE = 0x70000000
UID_SPAN = 1 << 24
"""Root-run sandboxes take a random uid from here: far above any login or subuid
range, so it owns no file on the host."""

MISSING = (
    "bubblewrap (bwrap) is not installed: install Debian's bubblewrap package "
    "(apt-get install bubblewrap), or run make install as root."
)


def default_python() -> str:
    """The base interpreter of this Python (``sys.base_prefix``), not the virtualenv's:
    sandboxed code gets the standard library and nothing we installed."""
    bindir = Path(sys.base_prefix) / "bin"
    for name in (f"python{sys.version_info.major}.{sys.version_info.minor}", "python3"):
        if (bindir / name).is_file():
            return str(bindir / name)
    return sys.executable


class BwrapSandbox(Sandbox):
    """Runs Python code in bubblewrap under :class:`SandboxLimits` (see the module).

    ``python`` is the interpreter the code runs with (default :func:`default_python`);
    its prefix is bound read-only. ``binds`` are more host paths bound read-only at
    the same place (a virtualenv, a dataset). ``bwrap`` names the bubblewrap binary.

    The constructor checks the machine once by running an empty program in the
    sandbox, and raises :class:`SandboxUnavailable` (one line) when bubblewrap or
    util-linux is missing or namespaces cannot be created.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        python: str | None = None,
        binds: Sequence[str] = (),
        bwrap: str = "bwrap",
    ) -> None:
        self.limits = limits or SandboxLimits()
        found = shutil.which(bwrap)
        if found is None:
            raise SandboxUnavailable(MISSING)
        self.bwrap = found
        self.python = python or default_python()
        if not os.access(self.python, os.X_OK):
            raise SandboxUnavailable(
                f"sandbox python must be an executable: got {self.python!r}. Point python= "
                f"at an interpreter (default: the one under sys.base_prefix)."
            )
        self.as_root = os.geteuid() == 0
        tools = ("prlimit", "setpriv") if self.as_root else ("prlimit",)
        paths = {t: shutil.which(t, path="/usr/bin:/bin") for t in tools}
        if None in paths.values():
            raise SandboxUnavailable(
                f"util-linux's {' and '.join(tools)} must be in /usr/bin for the sandbox: "
                f"install Debian's util-linux package (apt-get install util-linux)."
            )
        self._tools = {t: str(p) for t, p in paths.items()}
        self._fs = self._filesystem([*self._prefixes(), *binds])
        probe = self.run("pass")
        if not probe.ok:
            line = (probe.stderr.strip().splitlines() or [f"exit {probe.exit_code}"])[-1]
            if line.startswith("bwrap:"):
                raise SandboxUnavailable(
                    f"bubblewrap cannot create its namespaces here ({line}): allow user "
                    f"namespaces (sysctl user.max_user_namespaces=15000, and "
                    f"kernel.unprivileged_userns_clone=1 on Debian kernels) or run as root."
                )
            raise SandboxUnavailable(
                f"sandbox python {self.python!r} does not start inside bubblewrap "
                f"({probe.reason}: {line}): bind what it needs with binds= or pick another."
            )

    def _prefixes(self) -> list[str]:
        prefix = Path(self.python).resolve().parent.parent
        if any(prefix.is_relative_to(p) for p in SYSTEM_PATHS):
            return []
        return [str(prefix)]

    def _filesystem(self, binds: Sequence[str]) -> list[str]:
        """bwrap's filesystem arguments, without the work directory."""
        args: list[str] = []
        for path in SYSTEM_PATHS:
            if os.path.islink(path):
                args += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                args += ["--ro-bind", path, path]
        args += [a for f in ETC_FILES if os.path.exists(f) for a in ("--ro-bind", f, f)]
        made: set[str] = set()
        for bind in binds:
            real = str(Path(bind).resolve())
            # bubblewrap creates missing parents mode 0700 like their host originals
            # (/root is 0700): open them to the unprivileged user on the way down.
            for parent in reversed(PurePosixPath(real).parents[:-1]):
                if str(parent) not in made and not str(parent).startswith(SYSTEM_PATHS):
                    made.add(str(parent))
                    args += ["--perms", "0755", "--dir", str(parent)]
            args += ["--ro-bind", real, real]
        mb = 1 << 20
        args += ["--proc", "/proc", "--dev", "/dev"]
        args += ["--perms", "1777", "--size", str(self.limits.tmp_mb * mb), "--tmpfs", "/tmp"]
        return args

    def _uid(self) -> int | None:
        """The uid a run gets when root runs the sandbox (None otherwise)."""
        return UID_BASE + secrets.randbelow(UID_SPAN) if self.as_root else None

    def _command(self, host_work: str, uid: int | None) -> list[str]:
        lim, mb = self.limits, 1 << 20
        cmd = [self.bwrap, "--die-with-parent", "--new-session", "--clearenv"]
        if self.as_root:
            # No user namespace: setpriv below drops to a uid of the host's init
            # namespace, where RLIMIT_NPROC counts (inside a user namespace made by
            # root the code would still be kernel uid 0, exempt from it).
            cmd += ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts"]
            cmd += ["--unshare-cgroup-try"]
        else:
            cmd += ["--unshare-all"]
        cmd += self._fs
        cmd += ["--bind", host_work, WORKDIR, "--chdir", WORKDIR, "--remount-ro", "/"]
        env = {"PATH": "/usr/bin:/bin", "HOME": WORKDIR, "TMPDIR": "/tmp", "LANG": "C.UTF-8"}
        # glibc reserves 64 MiB of address space per malloc arena, one per thread by
        # default: under RLIMIT_AS that would cap a 256 MiB sandbox at 4 threads.
        env["MALLOC_ARENA_MAX"] = "2"
        for k, v in env.items():
            cmd += ["--setenv", k, v]
        if uid is not None:
            cmd += [self._tools["setpriv"], f"--reuid={uid}", f"--regid={uid}"]
            cmd += ["--clear-groups", "--no-new-privs", "--inh-caps=-all", "--bounding-set=-all"]
        cmd += [
            self._tools["prlimit"],
            f"--as={lim.memory_mb * mb}",
            f"--nproc={lim.max_processes}",
            f"--nofile={lim.max_open_files}",
            f"--fsize={lim.max_file_mb * mb}",
            "--core=0",
            f"--cpu={int(lim.time_s) + 1}",
            "--",
        ]
        return [*cmd, self.python, "-E", "-s", "-B", "-u", "main.py"]

    def run(self, code: str, stdin: str = "", files: Mapping[str, str] | None = None) -> RunResult:
        files = dict(files or {})
        for name in files:
            p = PurePosixPath(name)
            if p.is_absolute() or ".." in p.parts or not p.parts or name == "main.py":
                raise ValueError(
                    f"sandbox file name must be a relative path inside the work directory "
                    f"other than main.py: got {name!r}."
                )
        start = time.monotonic()
        host = tempfile.mkdtemp(prefix="phalanx-sandbox-")
        try:
            work = os.path.join(host, "work")
            os.mkdir(work)
            for name, text in {**files, "main.py": code}.items():
                path = os.path.join(work, name)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
            uid = self._uid()
            if uid is not None:  # the work directory and its files belong to the code
                for root, dirs, names in os.walk(work):
                    for name in [root, *(os.path.join(root, n) for n in dirs + names)]:
                        os.chown(name, uid, uid)
            with tempfile.TemporaryFile(dir=host) as fin:
                fin.write(stdin.encode("utf-8"))
                fin.seek(0)
                cmd = self._command(work, uid)
                return run_limited(cmd, stdin=fin, limits=self.limits, start=start)
        finally:
            shutil.rmtree(host, ignore_errors=True)

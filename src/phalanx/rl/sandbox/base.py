"""The sandbox interface: run model-written Python under limits, get a result back.

A :class:`Sandbox` never raises on anything the code it runs does: a crash, an
infinite loop, a memory hog, a fork bomb, an output flood or a forbidden syscall
all come back as a :class:`RunResult` whose ``reason`` says which. Only a sandbox
that cannot work on this machine at all (its tool missing, namespaces refused)
raises, at construction, :class:`SandboxUnavailable` with one line saying what to
install or change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Reason = Literal["ok", "error", "timeout", "memory", "output"]
"""Why a run ended: ``ok`` (exit status 0), ``error`` (a nonzero exit: an exception,
``sys.exit(1)``, a signal), ``timeout`` (killed at the wall-clock limit), ``memory``
(over the address-space limit: a ``MemoryError`` or an allocation failure),
``output`` (killed for writing more than the output limit)."""


class SandboxError(RuntimeError):
    """A sandbox could not be set up (never raised for what the sandboxed code does)."""


class SandboxUnavailable(SandboxError):
    """The sandbox's tool is missing or cannot create its namespaces on this machine;
    the message is one line saying what to install or change."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. The defaults suit a short tool call or a unit-test run."""

    time_s: float = 5.0
    """Wall-clock limit of one run, from the sandbox's start; the whole sandbox is
    killed when it passes (reason ``timeout``)."""
    memory_mb: int = 256
    """Address-space limit (``RLIMIT_AS``) of every process in the sandbox, in MiB."""
    max_output_bytes: int = 1 << 20
    """stdout and stderr together; past it the sandbox is killed (reason ``output``)."""
    keep_bytes: int = 16 << 10
    """How much of stdout (its head) and of stderr (its tail) the result keeps."""
    max_processes: int = 32
    """Processes and threads the sandboxed code may have at once (``RLIMIT_NPROC``,
    counted per sandbox): a fork bomb hits this instead of the machine."""
    max_open_files: int = 256
    """File descriptors per process (``RLIMIT_NOFILE``)."""
    max_file_mb: int = 16
    """Largest file a process may write (``RLIMIT_FSIZE``), in MiB."""
    tmp_mb: int = 64
    """Size of the private ``/tmp`` (a tmpfs, so it is host memory), in MiB."""

    def __post_init__(self) -> None:
        for name in ("time_s", "memory_mb", "max_output_bytes", "keep_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(
                    f"sandbox limit {name} must be > 0: got {getattr(self, name)!r}. "
                    f"Give a positive limit."
                )
        for name in ("max_processes", "max_open_files", "max_file_mb", "tmp_mb"):
            if not getattr(self, name) >= 1:
                raise ValueError(
                    f"sandbox limit {name} must be >= 1: got {getattr(self, name)!r}. "
                    f"Give a positive limit."
                )
        if self.memory_mb < 64:
            raise ValueError(
                f"sandbox limit memory_mb must be >= 64 (a Python interpreter needs about "
                f"30 MiB of address space to start): got {self.memory_mb}."
            )


@dataclass(frozen=True)
class RunResult:
    """The outcome of one run. ``stdout`` keeps its head and ``stderr`` its tail, each
    at most ``keep_bytes`` (decoded as UTF-8 with replacement), with a note in
    brackets where bytes were cut."""

    reason: Reason
    exit_code: int | None
    """The program's exit status; 128 + N when a signal N ended it inside the
    sandbox; None when the host killed it (timeout, output)."""
    stdout: str
    stderr: str
    wall_ms: float

    @property
    def ok(self) -> bool:
        return self.reason == "ok"


class Sandbox(ABC):
    """Runs Python source in isolation, one fresh private directory per run.

    Thread-safe: concurrent :meth:`run` calls get separate sandboxes.
    """

    limits: SandboxLimits

    @abstractmethod
    def run(self, code: str, stdin: str = "", files: Mapping[str, str] | None = None) -> RunResult:
        """Run ``code`` as the script ``main.py`` in a fresh work directory that also
        holds ``files`` (relative name -> text), with ``stdin`` as its standard input.

        Never raises for anything ``code`` does; raises ValueError (one line) only for
        a bad file name in ``files``.
        """

"""The state dir's lock: ``controller.lock``, an exclusive ``flock`` held for the
controller's lifetime, so that two controllers on one state dir are refused
instead of corrupting each other's view. The kernel releases it when the
process exits, even by SIGKILL."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class StateDirLocked(RuntimeError):
    """Another controller holds this state dir."""


class StateDirLock:
    """Exclusive lock on a state dir, released when the process exits (even by SIGKILL)."""

    def __init__(self, state_dir: Path):
        self.path = state_dir / "controller.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 200).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise StateDirLocked(
                f"state dir {self.path.parent} must be used by one controller at a time: it is "
                f"held by another controller ({holder}). Stop that controller, or start this "
                f"one with a different --state-dir."
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}".encode())
        self._fd = fd

    def note(self, text: str) -> None:
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, text.encode(), 0)

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

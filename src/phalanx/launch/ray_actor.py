"""What runs inside a Ray worker for one replica (:class:`ReplicaActor`): the
replica's program, ``phalanx <argv>``, in that worker process, with its output
captured line by line for the driver (:mod:`phalanx.launch.ray_executor`)."""

from __future__ import annotations

import os
import runpy
import sys
import threading
import time
import traceback


def run_cli(argv: list[str]) -> int:
    """``phalanx <argv>`` in this process, as ``python -m phalanx <argv>`` runs it
    (``runpy``: the executor runs the program it is given, it does not import the
    CLI), with the exit code that would have: ``SystemExit`` becomes its code (a
    message goes to stderr, code 1), an uncaught exception prints its traceback
    and gives 1."""
    saved = sys.argv
    sys.argv = ["phalanx", *argv]
    try:
        runpy.run_module("phalanx", run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.argv = saved
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass


class ReplicaActor:
    """The actor (made remote by :class:`RayExecutor`): runs one replica in its
    worker process, then nothing else. ``run`` is called once; ``ready`` and
    ``logs`` may be called at any time, concurrently with it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lines: list[str] = []
        self._base = 0
        """Line number of ``_lines[0]``: lines before it were pulled, and dropped."""
        self._partial = b""
        self._done = False
        self._started_at = time.time()

    def ready(self) -> tuple[float, int]:
        """When the actor started (wall clock), and its worker's pid."""
        return self._started_at, os.getpid()

    def logs(self, since: int) -> tuple[list[str], int, bool]:
        """Lines from ``since`` on, the next cursor, and whether the run ended with
        every line read. Lines before ``since`` are dropped: the caller has them."""
        with self._lock:
            drop = min(max(since - self._base, 0), len(self._lines))
            del self._lines[:drop]
            self._base += drop
            return list(self._lines), self._base + len(self._lines), self._done

    def _read(self, fd: int) -> None:
        while True:
            try:
                data = os.read(fd, 65536)
            except OSError:
                data = b""
            with self._lock:
                if not data:
                    if self._partial:
                        self._lines.append(self._partial.decode("utf-8", "replace"))
                        self._partial = b""
                    break
                *complete, self._partial = (self._partial + data).split(b"\n")
                self._lines += [ln.decode("utf-8", "replace").rstrip("\r") for ln in complete]
        os.close(fd)

    def run(self, argv: list[str], env: dict[str, str], cwd: str | None) -> int:
        os.environ.update(env)
        r, w = os.pipe()
        reader = threading.Thread(target=self._read, args=(r,), daemon=True, name="replica-logs")
        reader.start()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.close(w)
        try:
            if cwd is not None:
                os.chdir(cwd)  # inside the capture: a bad cwd is this replica's failure
            return run_cli(argv)
        except OSError as e:
            print(
                f"replica cwd must be a directory on the actor's node: got {cwd!r} ({e}).",
                file=sys.stderr,
            )
            return 1
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            # EOF comes once no process holds the pipe; children the command left
            # running still may, so do not wait for them.
            reader.join(timeout=5.0)
            with self._lock:
                self._done = True

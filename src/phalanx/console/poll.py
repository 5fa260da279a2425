"""The launcher's and the CLI's view of the controller: ``GET /v1/status`` as a
typed :class:`~phalanx.protocol.status.Status`, once (:func:`fetch_status`) or about
twice a second on a background thread (:class:`StatusPoller`; the launcher is
not a member of the job, so no replica client)."""

from __future__ import annotations

import threading
from pathlib import Path

from phalanx.client import ControllerError, ControllerUnreachable, Rejected, Transport
from phalanx.protocol.status import BatchRecord, Status


def fetch_status(controller: str, timeout_s: float = 10.0) -> Status:
    """One ``/v1/status`` of the controller named by URL or state dir, without
    retries. Raises :class:`ControllerError` in one line when it cannot be had."""
    t = Transport(controller, unreachable_timeout_s=0.0)
    try:
        return t.call("/v1/status", None, Status, timeout=timeout_s)
    except ControllerUnreachable as e:
        hint = (
            f"Is the job still running (state dir {t.state_dir})?"
            if t.state_dir is not None
            else "Is the job still running? A restarted controller may listen on another "
            "port: name it by its state dir, which always holds its current URL."
        )
        raise ControllerError(
            f"controller at {t.url} is unreachable: {e.last_error}. {hint}"
        ) from None
    except Rejected as e:
        raise ControllerError(
            f"controller at {t.url} answered {e.status}: {e.body.error}"
        ) from None
    finally:
        t.close()


class StatusPoller:
    """Keeps the latest controller status, and for RL jobs the first trained batch
    whose trailing mean exact match reached ``target``, or whose trailing mean
    reward reached ``target_reward`` (:attr:`target_metric` says which).

    A target counts only once the trailing window is full, as the controller's
    own stopping rule does: an early lucky batch is not a solved task.
    """

    def __init__(
        self,
        state_dir: Path,
        target: float | None = None,
        window: int = 1,
        interval_s: float = 0.5,
        target_reward: float | None = None,
    ):
        self.state_dir = state_dir
        self.target, self.window = target, window
        self.target_reward = target_reward
        self.interval_s = interval_s
        self.latest: Status | None = None
        self.errors = 0
        self.last_error = ""
        self.target_hit: BatchRecord | None = None
        self.target_metric: str | None = None
        """``exact match`` or ``reward``: the target the hit reached."""
        self.best: BatchRecord | None = None
        """The batch with the best trailing mean exact match."""
        self.best_reward: BatchRecord | None = None
        """The batch with the best trailing mean reward."""
        self._seen: tuple[float, int] = (float("-inf"), -1)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="phalanx-status", daemon=True)
        self._thread.start()

    def stop(self, final: bool = True) -> None:
        """Stop polling; with ``final``, fetch once more (the numbers the summary reports)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)
        if final:
            self.poll()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval_s)

    def poll(self) -> Status | None:
        try:
            st = fetch_status(str(self.state_dir), timeout_s=5.0)
        except ControllerError as e:
            self.errors += 1
            self.last_error = str(e)
            return None
        self._scan(st)
        self.latest = st
        return st

    def _scan(self, st: Status) -> None:
        if st.rl is None:
            return
        # By wall time, not batch index: after a policy rewind, batch numbers repeat.
        # Then by batch: one ack may train several batches at the same wall time (a
        # DiLoCo round's, or those of an ack lost and made by the next ask).
        for h in st.rl.history:
            if (h.at, h.batch) <= self._seen:
                continue
            self._seen = (h.at, h.batch)
            if self.best is None or h.exact_match_avg > self.best.exact_match_avg:
                self.best = h
            if self.best_reward is None or h.reward_avg > self.best_reward.reward_avg:
                self.best_reward = h
            if self.target_hit is not None or h.batch + 1 < self.window:
                continue
            if self.target is not None and h.exact_match_avg >= self.target:
                self.target_hit, self.target_metric = h, "exact match"
            elif self.target_reward is not None and h.reward_avg >= self.target_reward:
                self.target_hit, self.target_metric = h, "reward"

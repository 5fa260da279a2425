"""The launcher's view of the controller: ``GET /v1/status`` about twice a second on a
background thread (plain httpx with the job token from the state dir; no replica
client, since the launcher is not a member of the job)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx

from phalanx.client import ControllerError, find_token, resolve


def fetch_status(controller: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """One ``/v1/status`` of the controller named by URL or state dir. Raises
    :class:`ControllerError` with the controller's message when it refuses."""
    url, state_dir = resolve(controller)
    token = find_token(state_dir)
    try:
        r = httpx.get(
            f"{url}/v1/status", headers={"Authorization": f"Bearer {token}"}, timeout=timeout_s
        )
    except httpx.TransportError as e:
        hint = (
            f"Is the job still running (state dir {state_dir})?"
            if state_dir is not None
            else "Is the job still running? A restarted controller may listen on another "
            "port: name it by its state dir, which always holds its current URL."
        )
        raise ControllerError(
            f"controller at {url} is unreachable: {e or type(e).__name__}. {hint}"
        ) from None
    if r.status_code >= 400:
        raise ControllerError(f"controller at {url} answered {r.status_code}: {r.text[:300]}")
    data: dict[str, Any] = r.json()
    return data


class StatusPoller:
    """Keeps the latest controller status, and for RL jobs the first trained batch
    whose trailing mean exact match reached the target.

    The target counts only once the trailing window is full, as the controller's
    own stopping rule does: an early lucky batch is not a solved task.
    """

    def __init__(
        self,
        state_dir: Path,
        target: float | None = None,
        window: int = 1,
        interval_s: float = 0.5,
    ):
        self.state_dir = state_dir
        self.target, self.window = target, window
        self.interval_s = interval_s
        self.latest: dict[str, Any] | None = None
        self.errors = 0
        self.last_error = ""
        self.target_hit: dict[str, Any] | None = None
        self.best: dict[str, Any] | None = None
        self._seen_at = float("-inf")
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

    def poll(self) -> dict[str, Any] | None:
        try:
            st = fetch_status(str(self.state_dir), timeout_s=5.0)
        except (httpx.HTTPError, ControllerError, ValueError) as e:
            self.errors += 1
            self.last_error = str(e)
            return None
        self._scan(st)
        self.latest = st
        return st

    def _scan(self, st: dict[str, Any]) -> None:
        rl = st.get("rl")
        if not rl:
            return
        # By wall time, not batch index: after a policy rewind, batch numbers repeat.
        for h in rl.get("history", []):
            if h["at"] <= self._seen_at:
                continue
            self._seen_at = h["at"]
            if self.best is None or h["exact_match_avg"] > self.best["exact_match_avg"]:
                self.best = h
            if (
                self.target_hit is None
                and self.target is not None
                and h["batch"] + 1 >= self.window
                and h["exact_match_avg"] >= self.target
            ):
                self.target_hit = h

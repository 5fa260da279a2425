"""Writes trained rollouts to the job's Redis replay (``rl.transport.replay =
"redis://..."``), for the controller.

The ledger keeps each trained rollout it owes the replay in its ``replay_out``
table, with its payload held where the rollout store keeps it (module
:mod:`phalanx.controller.core.ledger.replay`). This task takes that outbox,
reads the payloads (from the payload log, or by ref from the external rollout
store), adds them to the replay in one script call, and then tells the core,
which lets the payloads go. A server that is down is retried every
:data:`RETRY_S`, with a warning and an event the first time; nothing trained is
lost meanwhile, nor at a controller restart (the outbox is journaled).

Each entry is the payload as the rollout replica made it (completions with
their behaviour log-probs, and its version), plus the summary the ledger's
draws read (``prompt``, ``reward``, ``exact_match``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from phalanx.config import JobConfig
from phalanx.controller.core.ledger import Ledger, payload_key
from phalanx.protocol.rl import RolloutPayload
from phalanx.transport.base import RolloutStore, TransportError, store_name
from phalanx.transport.replay import RedisReplayBuffer

log = logging.getLogger("phalanx.controller")

RETRY_S = 2.0
"""Seconds between attempts while the replay's server cannot be reached."""
DRAW_TIMEOUT_S = 1.0
"""How long the ledger's draw waits on the replay's server before it freezes a
batch from fresh rollouts only (it runs on the controller's loop)."""

Outbox = Callable[[], list[dict[str, Any]]]
"""The trained rollouts still to write (summary and ``ref``)."""
Written = Callable[[list[str]], None]
"""Tells the core these ids are written."""
Unreachable = Callable[[str], None]
"""Tells the core (an event) that the server could not be reached."""


def entry(row: dict[str, Any], payload: Any) -> dict[str, Any]:
    """The replay entry of a trained rollout: its payload as stored, and its summary."""
    doc = payload.model_dump(mode="json") if isinstance(payload, RolloutPayload) else dict(payload)
    return doc | {k: row[k] for k in ("prompt", "reward", "exact_match")}


class ReplayWriter:
    def __init__(
        self,
        replay: RedisReplayBuffer,
        payload_of: Callable[[str], Any] | None,
        store: RolloutStore | None,
    ):
        """``payload_of``: looks a payload up by ref in the controller's payload log
        (the ``controller`` rollout store); otherwise ``store`` is the external one."""
        self.replay, self.payload_of, self.store = replay, payload_of, store
        self.wake = asyncio.Event()
        self.down = False

    async def run(self, outbox: Outbox, written: Written, unreachable: Unreachable) -> None:
        """Until cancelled: write the outbox whenever :attr:`wake` is set."""
        loop = asyncio.get_running_loop()
        while True:
            await self.wake.wait()
            self.wake.clear()
            rows = outbox()
            if not rows:
                continue
            try:
                done = await loop.run_in_executor(None, self._write, rows, self._held(rows))
            except TransportError as e:
                if not self.down:
                    log.warning("replay: %d trained rollout(s) wait for %s", len(rows), e)
                    unreachable(str(e))
                self.down = True
                await asyncio.sleep(RETRY_S)
                self.wake.set()
                continue
            if self.down:
                log.info("replay: its server answers again")
            self.down = False
            written(done)

    def _held(self, rows: list[dict[str, Any]]) -> dict[str, Any]:
        """The payloads the payload log holds, read on the loop (where it lives)."""
        if self.payload_of is None:
            return {}
        return {r["ref"]: self.payload_of(payload_key(r["ref"])) for r in rows}

    def _write(self, rows: list[dict[str, Any]], held: dict[str, Any]) -> list[str]:
        """Add the rows to the replay (off the loop); returns the ids handled. A
        payload no store holds any more is left out: the ledger lets it go too."""
        if self.store is not None:
            held, _ = self.store.get([r["ref"] for r in rows])
        entries = [entry(r, held[r["ref"]]) for r in rows if held.get(r["ref"]) is not None]
        self.replay.add(entries)
        return [r["rollout_id"] for r in rows]

    def close(self) -> None:
        self.replay.close()
        if self.store is not None:
            self.store.close()


class DrawSource:
    """The Redis replay as the ledger's draws read it (``ZCARD``, ``ZRANGE`` by rank),
    with a warning in the controller's log when the server does not answer (the
    ledger then freezes the batch from fresh rollouts only, and counts it)."""

    def __init__(self, replay: RedisReplayBuffer):
        self.replay = replay

    def size(self) -> int:
        try:
            return self.replay.size()
        except TransportError as e:
            log.warning("replay: no draw for this batch (fresh rollouts only): %s", e)
            raise

    def entries_at(self, positions: list[int]) -> list[dict[str, Any] | None]:
        try:
            return self.replay.entries_at(positions)
        except TransportError as e:
            log.warning("replay: no draw for this batch (fresh rollouts only): %s", e)
            raise


def open_writer(
    cfg: JobConfig, led: Ledger | None, payload_of: Callable[[str], Any]
) -> ReplayWriter | None:
    """For a job with a Redis replay: attach the server's replay to the ledger's draws
    (with a short timeout), and return the writer of its outbox. None otherwise."""
    if cfg.rl is None or led is None or led.replay.kind != "redis":
        return None
    t = cfg.rl.transport
    url, name = str(t.replay), store_name(cfg.job.id, led.run)
    draws = RedisReplayBuffer(url, name, t.replay_size, timeout_s=DRAW_TIMEOUT_S)
    led.replay.remote = DrawSource(draws)
    store = None
    if t.rollouts != "controller":
        from phalanx.transport.factory import open_store

        store = open_store(t.rollouts, name)
    return ReplayWriter(
        RedisReplayBuffer(url, name, t.replay_size),
        payload_of if store is None else None,
        store,
    )

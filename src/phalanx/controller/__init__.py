"""The control plane: membership, quorum, commands, the RL ledger and the status
of one job, in two layers:

- ``core/``: the pure state machine (no I/O, ids and clocks passed in);
- around it, ``journal/`` (SQLite, or an etcd cluster), ``outbox.py`` (the journal
  write of every call, and the 503s while it cannot be made), ``payloads.py`` (the payload log),
  ``collector.py`` (drops from an external rollout store), ``service.py`` (the
  asyncio glue), ``http/`` (the routes), ``tls.py`` (HTTPS and the advertised
  URL) and ``server.py`` (start one).

Outside this package, nothing imports it but the ``phalanx controller``
command (:func:`serve`) and ``phalanx audit`` (:func:`ledger_balance`, the ledger
of a finished run's journal); replicas and tools speak :mod:`phalanx.protocol`
through :mod:`phalanx.client`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from phalanx.controller.lock import StateDirLocked
from phalanx.controller.statedir import CannotStart
from phalanx.controller.tls import check_tls, is_loopback, warn_if_clear_text

if TYPE_CHECKING:
    from phalanx.config import JobConfig

__all__ = [
    "CannotStart",
    "Deposed",
    "StateDirLocked",
    "check_tls",
    "is_loopback",
    "ledger_balance",
    "serve",
    "warn_if_clear_text",
]


def ledger_balance(
    cfg: JobConfig, tables: dict[str, dict[str, dict[str, Any]]], now: float
) -> dict[str, Any] | None:
    """The RL ledger's books (``Ledger.balance``: ``ok`` and where every prompt and
    rollout is) rebuilt from a journal's ``tables`` as a restarted controller rebuilds
    them, with nothing served; None for a job with no ledger. ``phalanx audit`` reads a
    finished run's journal with it."""
    from phalanx.controller.core.state import ControllerState

    st = ControllerState.restore(cfg, tables, now)
    return st.ledger.balance() if st.ledger is not None else None


def serve(
    cfg: JobConfig,
    state_dir: Path,
    host: str = "127.0.0.1",
    port: int = 0,
    fresh: bool = False,
    tls_cert: str | None = None,
    tls_key: str | None = None,
) -> None:
    """Run a controller in this process until it is stopped (SIGINT/SIGTERM). ``fresh``:
    a damaged journal is set aside and the job begins again, instead of a refusal.
    ``tls_cert``/``tls_key``: PEM files (both or neither) to serve HTTPS with."""
    from phalanx.controller.server import serve as run

    run(cfg, state_dir, host, port, fresh, tls_cert, tls_key)


def __getattr__(name: str) -> Any:
    # Lazy: the journal package imports the config and the core, which `phalanx
    # controller --help` and a refused start need not pay for.
    if name == "Deposed":
        from phalanx.controller.journal.base import Deposed

        return Deposed
    raise AttributeError(f"module 'phalanx.controller' has no attribute {name!r}")

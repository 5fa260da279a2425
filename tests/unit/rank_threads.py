"""Ranks as threads of the test process: plain, or over one real gloo process group."""

from __future__ import annotations

import threading
from collections.abc import Callable

from phalanx.comm.torch_pg import TorchCommunicator, serve_store


def run_threads(
    n: int,
    body: Callable[[int], None],
    on_error: Callable[[BaseException], None] | None = None,
    timeout_s: float = 60.0,
) -> None:
    """Run ``body(rank)`` for ranks 0..n-1, each on its own thread, and raise the
    first error. ``on_error`` runs in the failing thread (e.g. to free the others
    from a barrier)."""
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            body(rank)
        except BaseException as e:  # surfaced below
            errors.append(e)
            if on_error is not None:
                on_error(e)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]


def run_ranks(comms: list[TorchCommunicator], prefix: str, body: Callable[[int], None]) -> None:
    """Configure ``comms`` as ranks 0..k-1 of one group (a TCPStore served here),
    then run ``body(rank)`` for each on its own thread (:func:`run_threads`)."""
    store, address = serve_store()

    def ranked(rank: int) -> None:
        comms[rank].configure(address, prefix, rank, len(comms))
        body(rank)

    try:
        run_threads(len(comms), ranked)
    finally:
        for c in comms:
            c.abort()
        del store

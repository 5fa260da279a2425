"""Ranks of one real gloo process group, as threads of the test process."""

from __future__ import annotations

import threading
from collections.abc import Callable

from phalanx.comm.torch_pg import TorchCommunicator, serve_store


def run_ranks(comms: list[TorchCommunicator], prefix: str, body: Callable[[int], None]) -> None:
    """Configure ``comms`` as ranks 0..k-1 of one group (a TCPStore served here),
    run ``body(rank)`` for each on its own thread, and raise the first error."""
    store, address = serve_store()
    errors: list[BaseException] = []

    def work(rank: int) -> None:
        try:
            comms[rank].configure(address, prefix, rank, len(comms))
            body(rank)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(r,)) for r in range(len(comms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for c in comms:
        c.abort()
    del store
    assert not errors, errors

"""One rank of a two-process gloo group, for tests/integration/test_liveness.py.

    python liveness_worker.py RANK MODE [TIMEOUT_S]

Prints ``{"address": ...}`` (its store, which answers liveness pings), reads its
peer's address from stdin, joins the group at rank 0's store (collective timeout
TIMEOUT_S, 0.5 s by default; patience 20 s), watches the peer, then by MODE:

- ``reduce``: all-reduces at once, then all-reduces a vote (as a patient step does:
  an op of its own, after the data), and prints ``{"ok", "sum", "votes",
  "elapsed_s", "error"}``;
- ``announce``: prints ``{"reducing": true}``, then as ``reduce``;
- ``late``: sleeps 2 s (alive), then all-reduces;
- ``send`` / ``late-recv``: rank 0 sends 4 float64s to rank 1, which posts its
  receive 2 s late; each prints ``{"ok", "got", "elapsed_s", "error"}``;
- ``hold``: prints ``{"holding": true}``, then waits for a line on stdin (the test
  SIGSTOPs it meanwhile), then all-reduces;
- ``leave``: drops the group, prints ``{"left": true}`` and sleeps.

Then it stays alive (holding what it gave up) until the test kills it.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from phalanx.comm.base import CommError
from phalanx.comm.torch_pg import TorchCommunicator, serve_store

TIMEOUT_S, PATIENCE_S = 0.5, 20.0


def say(obj: object) -> None:
    print(json.dumps(obj), flush=True)


def p2p(comm: TorchCommunicator, rank: int) -> None:
    t = torch.arange(4, dtype=torch.float64) if rank == 0 else torch.zeros(4, dtype=torch.float64)
    t0 = time.monotonic()
    try:
        comm.send(t, 1) if rank == 0 else comm.recv(t, 0)
        say({"ok": True, "got": t.tolist(), "elapsed_s": time.monotonic() - t0, "error": None})
    except CommError as e:
        say({"ok": False, "got": None, "elapsed_s": time.monotonic() - t0, "error": str(e)})
    time.sleep(600)


def main() -> None:
    rank, mode = int(sys.argv[1]), sys.argv[2]
    timeout_s = float(sys.argv[3]) if len(sys.argv) > 3 else TIMEOUT_S
    store, address = serve_store()
    say({"address": address})
    peer = sys.stdin.readline().strip()
    comm = TorchCommunicator(timeout_s, patience_s=PATIENCE_S)
    comm.configure(address if rank == 0 else peer, "liveness/q1", rank, 2)
    comm.watch({"peer": peer})
    if mode == "hold":
        say({"holding": True})
        sys.stdin.readline()
    if mode == "leave":
        comm.abort()
        say({"left": True})
        time.sleep(600)
    if mode in ("late", "late-recv"):
        time.sleep(2.0)
    if mode in ("send", "late-recv"):
        p2p(comm, rank)
    t = torch.full((4,), float(rank + 1), dtype=torch.float64)
    if mode == "announce":
        say({"reducing": True})
    t0 = time.monotonic()
    vote = torch.ones(1, dtype=torch.float64)
    out: dict[str, object] = {"ok": False, "sum": None, "votes": None, "error": None}
    try:
        comm.allreduce([t])
        out["sum"] = t.tolist()
        comm.allreduce([vote])
        out["ok"], out["votes"] = True, vote.item()
    except CommError as e:
        out["error"] = str(e)
    say({**out, "elapsed_s": time.monotonic() - t0})
    time.sleep(600)
    del store


if __name__ == "__main__":
    main()

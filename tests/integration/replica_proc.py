"""A replica process for the integration tests: the control-plane half of a
training loop, with no model.

It registers with the controller through :class:`ControllerClient`, keeps
the heartbeat going, and then runs quorum rounds one step at a time: ask
for the quorum at the committed step, "heal" to the quorum's ``max_step``
if behind, "train" that step and commit it. It prints one JSON line per
formed quorum on stdout (flushed), so the test can check what every
replica saw. SIGTERM makes it leave cleanly (deregister) and exit 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time

from phalanx.client import ControllerClient
from phalanx.log import setup


class Leave(Exception):
    """Raised by the SIGTERM handler to unwind into a clean deregister."""


def _leave(signum: int, frame: object) -> None:
    raise Leave()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--controller", required=True, help="controller state dir or URL")
    ap.add_argument("--name", required=True)
    ap.add_argument("--role", default="policy")
    ap.add_argument("--step-delay", type=float, default=0.05, help="seconds per 'training' step")
    args = ap.parse_args()

    setup(logging.INFO)
    signal.signal(signal.SIGTERM, _leave)
    client = ControllerClient(args.controller, args.role, args.name)
    committed = 0
    try:
        client.start_heartbeat()
        while True:
            q = client.quorum(committed)
            step = q.max_step  # a replica behind the quorum heals to max_step first
            line = {
                "step": step,
                "quorum_id": q.quorum_id,
                "round": q.round,
                "members": q.replica_ids,
                # Not client.replica_id: the heartbeat thread may have registered a
                # new incarnation while this (older) answer was in flight.
                "replica_id": next(m.replica_id for m in q.members if m.name == args.name),
                "incarnation": client.incarnations,
                "epoch": client.epoch,
            }
            print(json.dumps(line), flush=True)
            time.sleep(args.step_delay)
            committed = step + 1
            client.report_progress(step=committed)
    except Leave:
        client.close("sigterm")
        return 0


if __name__ == "__main__":
    sys.exit(main())

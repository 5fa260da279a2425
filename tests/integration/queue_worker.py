"""A rollout-queue producer or consumer in a process of its own (the contract
suite's cross-process cases). Prints JSON lines; nothing is pickled.

    python queue_worker.py produce SPEC PREFIX COUNT BATCH
    python queue_worker.py consume SPEC STOPFILE      # acks until STOPFILE exists and nothing is left
    python queue_worker.py crash SPEC N               # leases N, prints them, dies without acking
    python queue_worker.py slow SPEC N GOFILE         # leases N, prints them, acks once GOFILE exists

SPEC is JSON: {"kind": "controller" | "redis" | "spool", "url": ..., "name": ..., "lease_s": ...,
"options": {...}} (``url``: the controller's state dir for ``controller``; ``options``: fsspec
storage options for a spool).

A consumer prints what it was delivered (``delivered``: [rollout id, attempt] pairs) and what it
consumed (``acked``): the rollouts whose ack counted. A rollout can be delivered twice (its lease
expired before the ack: at-least-once); the queue counts one ack of it, and the consumer whose ack
counted nothing (``late``) did not consume it (RolloutQueue.ack).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from phalanx.transport.base import Delivery, RolloutQueue


def open_queue(spec: dict[str, Any], consumer: str) -> RolloutQueue:
    if spec["kind"] == "controller":
        from phalanx.transport.controller_queue import ControllerRolloutQueue

        return ControllerRolloutQueue(spec["url"], spec["name"], consumer, lease_s=spec["lease_s"])
    if spec["kind"] == "redis":
        from phalanx.transport.redis_queue import RedisRolloutQueue

        return RedisRolloutQueue(spec["url"], spec["name"], consumer, lease_s=spec["lease_s"])
    from phalanx.transport.spool import SpoolRolloutQueue

    return SpoolRolloutQueue(
        spec["url"], consumer, lease_s=spec["lease_s"], storage_options=spec.get("options")
    )


def rollout(rid: str) -> dict[str, Any]:
    return {"rollout_id": rid, "version": 0, "reward": 1.0, "payload": [1, 2, 3]}


def settle(q: RolloutQueue, ds: list[Delivery]) -> dict[str, list[Any]]:
    """Ack each delivery alone, to learn which acks counted."""
    counted = {d.rollout_id: q.ack([d]) == 1 for d in ds}
    return {
        "delivered": [[d.rollout_id, d.attempt] for d in ds],
        "acked": [r for r, ok in counted.items() if ok],
        "late": [r for r, ok in counted.items() if not ok],
    }


def main() -> None:
    cmd, spec = sys.argv[1], json.loads(sys.argv[2])
    me = f"{cmd}-{os.getpid()}-{uuid.uuid4().hex[:4]}"
    q = open_queue(spec, me)
    if cmd == "produce":
        prefix, count, batch = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
        for i in range(0, count, batch):
            ids = [f"{prefix}{j}" for j in range(i, min(count, i + batch))]
            q.put([rollout(r) for r in ids])
            print(json.dumps({"put": ids}), flush=True)
    elif cmd == "consume":
        stop = Path(sys.argv[3])
        while True:
            ds = q.lease(7, wait_s=0.2)
            if ds:
                print(json.dumps(settle(q, ds)), flush=True)
            elif stop.exists() and q.pending() == 0:
                break
    elif cmd == "crash":
        ds = q.lease(int(sys.argv[3]), wait_s=5.0)
        out = {"leased": [d.rollout_id for d in ds], "deadlines": [d.deadline for d in ds]}
        print(json.dumps(out), flush=True)
        time.sleep(0.05)
        os._exit(9)  # no ack, no cleanup: a consumer killed between its lease and its ack
    elif cmd == "slow":
        ds = q.lease(int(sys.argv[3]), wait_s=5.0)
        print(json.dumps({"delivered": [[d.rollout_id, d.attempt] for d in ds]}), flush=True)
        go = Path(sys.argv[4])
        while not go.exists():
            time.sleep(0.02)
        print(json.dumps(settle(q, ds)), flush=True)


if __name__ == "__main__":
    main()

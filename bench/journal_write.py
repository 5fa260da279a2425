"""The cost of one journal write, SQLite against etcd, for the batches a quorum round
really makes.

    python bench/journal_write.py --etcd etcd://127.0.0.1:2379 [--n 100] [--rounds 20]

It drives the controller's core as a job of N replicas does (register, then rounds
of one quorum request per replica, each one core call), records the batch each call
journals, and writes the same batches, in order, to a fresh SQLite journal (in a
temp dir, ``journal_sync = normal``) and to an etcd journal on its own prefix (the
etcd named: start one first, e.g. Debian's ``etcd``). Prints per-write p50/p99 and
the journal time of one round (N writes), for both, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from phalanx.config import load_config
from phalanx.config.journal import parse_etcd
from phalanx.controller.core.base import Change
from phalanx.controller.core.state import ControllerState
from phalanx.controller.journal import Journal, SqliteJournal
from phalanx.controller.journal.etcd import EtcdJournal


def record(n: int, rounds: int) -> list[list[Change]]:
    """The batches of a job of ``n`` replicas: its registrations, then ``rounds``."""
    cfg = load_config(overrides=[f"--roles.policy.n_init_replicas={n}"])
    st = ControllerState(cfg)
    st.start(0.0, 0.0)
    batches = [st.drain()]
    ids = []
    for i in range(n):
        ids.append(st.register("policy", f"r{i}", "i0", now=0.0, wall=0.0)[0].replica_id)
        batches.append(st.drain())
    for r in range(rounds):
        for rid in ids:
            st.request_quorum(rid, r, f"{rid}-{r}", 60.0, now=1.0 + r, wall=1.0 + r)
            batches.append(st.drain())
    return [b for b in batches if b]


def timed(journal: Journal, batches: list[list[Change]]) -> list[float]:
    out = []
    for b in batches:
        t0 = time.perf_counter()
        journal.write(b)
        out.append(time.perf_counter() - t0)
    journal.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--etcd", required=True, help="etcd://host:port of a running etcd")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    batches = record(args.n, args.rounds)
    rounds = batches[-args.n * args.rounds :]
    with tempfile.TemporaryDirectory() as d:
        lite = timed(SqliteJournal(Path(d) / "j.sqlite"), batches)[-len(rounds) :]
    target = parse_etcd(f"{args.etcd.rstrip('/')}/bench{uuid.uuid4().hex[:8]}")
    etcd = timed(EtcdJournal(target, "bench", "http://bench"), batches)[-len(rounds) :]
    out = {"n": args.n, "rounds": args.rounds, "rows_per_write": statistics.mean(map(len, rounds))}
    for name, t in (("sqlite", lite), ("etcd", etcd)):
        q = statistics.quantiles(t, n=100)
        out[f"{name}_write_p50_ms"] = round(q[49] * 1e3, 3)
        out[f"{name}_write_p99_ms"] = round(q[98] * 1e3, 3)
        out[f"{name}_round_ms"] = round(sum(t) / args.rounds * 1e3, 1)
    out["round_ratio"] = round(out["etcd_round_ms"] / out["sqlite_round_ms"], 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()

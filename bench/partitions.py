"""Partitions benchmark: the FT job across hosts made of network namespaces
(:mod:`phalanx.testing.netns`, root only), cut apart with nftables while it runs.

    python bench/partitions.py [--json] [--hold 5] [--loss-hold 30] [--lossy-tcp]

A controller on host ``c`` and three replicas on ``r1``..``r3`` (the built-in
float64 MLP, global batch 24 in micro-batches of 4, paced at 0.03 s per
micro-batch, every step line carrying a digest of the parameters), with the
default test timeouts: collective 1 s, heartbeat 2 s, suspect grace 0.25 s,
and the policy role's default join timeout, 1 s (``--join-timeout-s``: how long
a round waits for a replica still finishing the last step; before 2026-11-26
this bench used 0.5 s). For each kind, on a fresh job, once the three commit together:

- ``replica_from_controller``: r3 cannot reach c (nor c r3); its peers still can;
- ``replica_from_peers``: r3 cannot reach r1 and r2; the controller still can;
- ``minority_from_all``: r3 cut from every other host;
- ``controller_from_all``: c cut from every replica;
- ``loss``: 20% of the packets between the replicas dropped at random where
  they arrive, each way (the controller's traffic untouched), for
  ``--loss-hold`` seconds.

The cut lasts ``--hold`` seconds (past the heartbeat timeout), then heals.
Figures per kind:

- ``stall_s``: from the cut to the survivors' (r1's) next commit without r3.
  For ``controller_from_all`` there is none (nobody can form a quorum): null.
  For ``loss``: the longest gap between r1's commits during the loss.
- ``resume_s``: from the heal to the next commit of all three together.
- ``divergent_commits``: steps that two replicas committed with different
  parameters (over every step of the run).
- ``collective_timeout_s``: the job's collective timeout, for the goal
  (stall <= collective timeout + 0.5 s); ``--collective-s`` sets it (and the
  heartbeat timeout to 1 s more).

TCP's retransmission clock, in every namespace host (an operator's tuning of
a lossy network, docs/operations.md; the figures without these flags are the
kernel's defaults): ``--rto-min-ms`` sets ``net.ipv4.tcp_rto_min_us`` (default
200 ms), ``--rto-max-ms`` sets ``net.ipv4.tcp_rto_max_ms`` (default 120 s; at
least 1000), ``--thin-linear`` sets ``net.ipv4.tcp_thin_linear_timeouts`` (a
connection with few segments in flight retransmits 6 times at the same
timeout before backing off), and ``--lossy-tcp`` is all three at 20 ms,
1000 ms and on. ``--quickack`` sets ``quickack 1`` on each host's route (no
delayed ACKs, whose delay otherwise enters the RTO).

Root only: the namespaces, the veth pairs and the nftables rules are made here
and removed at the end, even after a failure. Traffic goes only to addresses
inside the namespaces made here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from phalanx.testing import netns

PY = sys.executable
TIMEOUTS = {
    "collective_s": 1.0,
    "heartbeat_s": 2.0,
    "heartbeat_interval_s": 0.2,
    "suspect_grace_s": 0.25,
    "quorum_s": 30.0,
}
KINDS = {
    "replica_from_controller": ("r3", ["c"]),
    "replica_from_peers": ("r3", ["r1", "r2"]),
    "minority_from_all": ("r3", ["c", "r1", "r2"]),
    "controller_from_all": ("c", ["r1", "r2", "r3"]),
    "loss": ("r1", ["r2", "r3"]),  # (and r2, r3 with their peers)
}
WAIT_S = 240.0


def job_toml(path: Path, timeouts: dict[str, float], join_timeout_s: float) -> Path:
    sections: dict[str, dict[str, Any]] = {
        "job": {"id": "partitions", "seed": 7},
        "timeouts": timeouts,
        "controller": {"tick_s": 0.02},
        "roles.policy": {"min_replicas": 1, "n_init_replicas": 3, "join_timeout_s": join_timeout_s},
        "train": {
            "steps": 1_000_000,
            "dtype": "float64",
            "in_dim": 8,
            "hidden": [32],
            "out_dim": 2,
            "dataset_size": 512,
            "global_batch_size": 24,
            "micro_batch_size": 4,
            "step_delay_s": 0.03,
            "log_state_hash": True,
        },
    }
    lines = []
    for name, values in sections.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


class Run:
    """One job: a controller and three replicas on the namespace hosts."""

    def __init__(
        self, net: netns.Net, work: Path, timeouts: dict[str, float], join_timeout_s: float
    ):
        self.net, self.work = net, work
        self.config = job_toml(work / "job.toml", timeouts, join_timeout_s)
        self.state = work / "state"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.outs: dict[str, Path] = {}

    def spawn(self, host: netns.Host, label: str, args: list[str]) -> None:
        env = {**os.environ, "PHALANX_ADVERTISE_HOST": host.ip, "OMP_NUM_THREADS": "1"}
        out = self.outs[label] = self.work / f"{label}.out"
        with out.open("wb") as o, (self.work / f"{label}.err").open("wb") as e:
            self.procs.append(
                subprocess.Popen(
                    host.wrap(args), stdout=o, stderr=e, env=env, start_new_session=True
                )
            )

    def start(self) -> None:
        h = self.net.hosts
        ctl = [PY, "-m", "phalanx.cli", "controller", "--config", str(self.config)]
        self.spawn(h["c"], "c", [*ctl, "--state-dir", str(self.state), "--host", h["c"].ip])
        deadline = time.monotonic() + WAIT_S
        while not (self.state / "url").exists():
            if time.monotonic() > deadline:
                raise SystemExit("bench/partitions: the controller did not start")
            time.sleep(0.05)
        for name in ("r1", "r2", "r3"):
            rep = [PY, "-m", "phalanx.cli", "replica", "--config", str(self.config)]
            self.spawn(h[name], name, [*rep, "--controller", str(self.state), "--name", name])

    def steps(self, name: str) -> list[dict[str, Any]]:
        """The step lines of replica ``name`` so far, each with the time it was read."""
        text = self.outs[name].read_text(errors="replace")
        return [json.loads(x) for x in text.splitlines() if x.startswith('{"') and '"step"' in x]

    def wait(self, what: str, pred: Any) -> float:
        """Wait until ``pred()`` gives a commit time (wall clock); return it."""
        deadline = time.monotonic() + WAIT_S
        while True:
            t = pred()
            if t is not None:
                return float(t)
            if time.monotonic() > deadline:
                raise SystemExit(f"bench/partitions: no {what} in {WAIT_S} s")
            time.sleep(0.02)

    def first(self, name: str, since: float, participants: int) -> float | None:
        for e in self.steps(name):
            if e["event"] == "step" and e["t"] > since and e["participants"] == participants:
                return float(e["t"])
        return None

    def divergent(self) -> int:
        by_step: dict[int, set[str]] = {}
        for name in ("r1", "r2", "r3"):
            for e in self.steps(name):
                if e["event"] == "step":
                    by_step.setdefault(e["step"], set()).add(e["state_hash"])
        return sum(1 for hashes in by_step.values() if len(hashes) > 1)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
        for p in self.procs:
            p.wait(timeout=30)


def max_or_none(ts: list[float | None]) -> float | None:
    """The latest of ``ts``, or None while any is missing."""
    return None if any(t is None for t in ts) else max(t for t in ts if t is not None)


def measure(
    net: netns.Net,
    kind: str,
    hold: float,
    work: Path,
    timeouts: dict[str, float],
    join_timeout_s: float,
) -> dict[str, Any]:
    who, others = KINDS[kind]
    h = net.hosts
    run = Run(net, work, timeouts, join_timeout_s)
    try:
        run.start()
        run.wait(
            "three together", lambda: max_or_none([run.first(n, 0, 3) for n in ("r1", "r2", "r3")])
        )
        time.sleep(1.0)  # a few steps of the three together
        cut = time.time()
        if kind == "loss":
            for a, b in (("r1", "r2"), ("r1", "r3"), ("r2", "r3")):
                net.loss(h[a], [h[b]], 20)  # each pair once: 20% each way
        else:
            net.cut(h[who], [h[o] for o in others])
        stall: float | None = None
        if who == "r3":
            stall = run.wait("commit without r3", lambda: run.first("r1", cut, 2)) - cut
        time.sleep(hold)
        for x in h.values():
            net.heal(x)
        healed = time.time()
        if kind == "loss":
            ts = [
                e["t"] for e in run.steps("r1") if e["event"] == "step" and cut <= e["t"] <= healed
            ]
            gaps = [b - a for a, b in zip([cut, *ts], [*ts, healed], strict=True)]
            stall = max(gaps) if gaps else None
        back = run.wait("three together again", lambda: run.first("r1", healed, 3))
        return {
            "kind": kind,
            "stall_s": None if stall is None else round(stall, 3),
            "resume_s": round(back - healed, 3),
            "collective_timeout_s": timeouts["collective_s"],
            "divergent_commits": run.divergent(),
        }
    finally:
        run.stop()
        for x in h.values():
            net.heal(x)


def tcp_sysctls(args: argparse.Namespace) -> list[str]:
    """The sysctl assignments for TCP's retransmission clock the flags ask for."""
    out = []
    if args.rto_min_ms:
        out.append(f"net.ipv4.tcp_rto_min_us={int(args.rto_min_ms * 1000)}")
    if args.rto_max_ms:
        out.append(f"net.ipv4.tcp_rto_max_ms={args.rto_max_ms}")
    if args.thin_linear:
        out.append("net.ipv4.tcp_thin_linear_timeouts=1")
    return out


def quickack(host: netns.Host) -> None:
    """Turn delayed ACKs off on ``host``'s route to the switch (``ip route ... quickack 1``)."""
    shown = subprocess.run(
        host.wrap(["ip", "route", "show", "proto", "kernel"]),
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    subprocess.run(host.wrap(["ip", "route", "replace", *shown, "quickack", "1"]), check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="one JSON object per kind")
    ap.add_argument("--hold", type=float, default=5.0, help="seconds each cut lasts")
    ap.add_argument("--loss-hold", type=float, default=30.0, help="seconds of packet loss")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kinds")
    ap.add_argument("--keep", default="", help="keep each run's logs under this folder")
    ap.add_argument(
        "--rto-min-ms", type=float, default=0.0, help="TCP's least RTO in each host (0: default)"
    )
    ap.add_argument(
        "--rto-max-ms", type=int, default=0, help="TCP's largest RTO in each host (0: default)"
    )
    ap.add_argument(
        "--thin-linear", action="store_true", help="linear retransmission timeouts (thin streams)"
    )
    ap.add_argument("--quickack", action="store_true", help="no delayed ACKs on each host's route")
    ap.add_argument(
        "--lossy-tcp", action="store_true", help="--rto-min-ms 20 --rto-max-ms 1000 --thin-linear"
    )
    ap.add_argument(
        "--join-timeout-s",
        type=float,
        default=1.0,
        help="the policy role's join_timeout_s (how long a round waits for stragglers)",
    )
    ap.add_argument(
        "--collective-s",
        type=float,
        default=TIMEOUTS["collective_s"],
        help="collective timeout (the heartbeat timeout is 1 s more)",
    )
    args = ap.parse_args()
    if args.lossy_tcp:
        args.rto_min_ms, args.rto_max_ms, args.thin_linear = 20.0, 1000, True
    if args.rto_max_ms and args.rto_max_ms < 1000:
        raise SystemExit(
            f"bench/partitions: --rto-max-ms must be at least 1000 (the kernel's "
            f"least), got {args.rto_max_ms}"
        )
    tcp = tcp_sysctls(args)
    why = netns.unavailable()
    if why is not None:
        raise SystemExit(f"bench/partitions: {why}")
    net = netns.Net()
    results = []
    try:
        for name in ("c", "r1", "r2", "r3"):
            host = net.add_host(name)
            if tcp:
                subprocess.run(host.wrap(["sysctl", "-qw", *tcp]), check=True)
            if args.quickack:
                quickack(host)
        with tempfile.TemporaryDirectory(prefix="phalanx-partitions-") as tmp_dir:
            tmp = args.keep or tmp_dir
            for kind in args.kinds.split(","):
                hold = args.loss_hold if kind == "loss" else args.hold
                work = Path(tmp) / kind
                work.mkdir(parents=True)
                c = args.collective_s
                timeouts = {**TIMEOUTS, "collective_s": c, "heartbeat_s": max(2.0, c + 1)}
                r = measure(net, kind, hold, work, timeouts, args.join_timeout_s)
                r["tcp_rto_min_ms"] = args.rto_min_ms or 200.0
                r["tcp_rto_max_ms"] = args.rto_max_ms or 120000
                r["tcp_thin_linear_timeouts"] = args.thin_linear
                results.append(r)
                if not args.json:
                    print(
                        f"{kind:24s} stall {r['stall_s']} s  resume {r['resume_s']} s  "
                        f"divergent commits {r['divergent_commits']}",
                        flush=True,
                    )
    finally:
        net.close()
    if args.json:
        for r in results:
            print(json.dumps(r))


if __name__ == "__main__":
    main()

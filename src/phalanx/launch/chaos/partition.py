"""``--chaos partition-every``: one replica cut off from every other process on this
host, with nftables and no network namespace.

How a replica is told apart on one host: the launcher starts each replica with a
group id of its own (:func:`gid_of`: a gid in no ``/etc/group``, from a range
derived from the launcher's pid, so that two runs never share one). Every socket
the replica opens then carries that gid (the kernel records the opener's
credentials), and nftables matches it on output (``meta skgid``). The uid stays
root's, so its files are what they would be.

A partition adds one rule, ``meta skgid G drop``, to an output chain (hook output,
priority 0, policy accept) of a table of the run's own (``inet
phalanx_chaos_<launcher pid>``), then deletes exactly that rule (by the handle
``nft --echo --handle`` gave) at its end. Every packet the replica sends is
dropped: its requests to the controller, its gloo traffic, and its TCP ACKs, so
what others send it is never acknowledged either. It is cut off both ways, as a
partitioned host is, and no reset tells anyone (open connections go silent).

The table is made at the first partition and deleted by :meth:`Cuts.close` (the
runner's ``close``, in the launcher's ``finally``). A table left by a launcher
that was SIGKILLed (its pid gone) is deleted when the next run makes its own.

Who calls: the chaos runner (:mod:`.runner`), from the launcher's loop, with the
launcher's lock held.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from typing import TYPE_CHECKING

from phalanx.launch.chaos.faults import ready, where
from phalanx.launch.chaos.log import ChaosLog
from phalanx.launch.chaos.schedule import Schedule
from phalanx.launch.procs import pid_alive

if TYPE_CHECKING:
    from phalanx.launch.chaos.base import ChaosTarget

GID_BASE = 2_000_000_000
"""The replicas' gids: ``GID_BASE + (launcher pid % 10000) * 10000 + n`` (below 2**31,
above any gid a distribution hands out)."""
TABLE_PREFIX = "phalanx_chaos_"
CHAIN = "out"


def unavailable() -> str | None:
    """Why partitions cannot be delivered here (one line), or None."""
    if os.geteuid() != 0:
        return (
            "--chaos partition-every needs root (it drops a replica's packets with "
            "nftables): run phalanx run as root, or drop partition-every."
        )
    if shutil.which("nft") is None:
        return (
            "--chaos partition-every needs nftables' nft command, which is not installed: "
            "install nftables (apt-get install nftables), or drop partition-every."
        )
    return None


def gid_of(gids: dict[str, int], name: str, pid: int | None = None) -> int:
    """Replica ``name``'s gid, given once and kept (a restart of it gets the same, so a
    replica restarted while cut off stays cut off, as a partitioned host's would)."""
    if name not in gids:
        base = GID_BASE + ((os.getpid() if pid is None else pid) % 10000) * 10000
        gids[name] = base + len(gids) + 1
    return gids[name]


def nft(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """``nft ARGS`` (``-f -`` reads ``stdin``); raises ``RuntimeError`` in one line."""
    done = subprocess.run(["nft", *args], input=stdin, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"nft {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def tables() -> list[str]:
    """The ``inet`` tables of this host's nftables whose names are ours."""
    out = json.loads(nft("-j", "list", "tables").stdout or "{}")
    names = [x["table"]["name"] for x in out.get("nftables", []) if "table" in x]
    return [n for n in names if n.startswith(TABLE_PREFIX)]


class Cuts:
    """The run's nftables table, and the rules of the partitions that last."""

    def __init__(self, pid: int | None = None):
        self.table = f"{TABLE_PREFIX}{os.getpid() if pid is None else pid}"
        self.made = False

    def _make(self) -> None:
        for name in tables():  # tables of launchers that died without their finally
            tail = name.removeprefix(TABLE_PREFIX)
            if name != self.table and tail.isdigit() and not pid_alive(int(tail)):
                nft("delete", "table", "inet", name)
        nft(
            "-f", "-",
            stdin=f"add table inet {self.table}\n"
            f"add chain inet {self.table} {CHAIN} "
            "{ type filter hook output priority 0; policy accept; }\n",
        )  # fmt: skip
        self.made = True

    def cut(self, gid: int) -> int:
        """Drop every packet of sockets with group ``gid``; returns the rule's handle."""
        if not self.made:
            self._make()
        rule = ["add", "rule", "inet", self.table, CHAIN, "meta", "skgid", str(gid), "drop"]
        out = json.loads(nft("--echo", "--handle", "-j", *rule).stdout)
        (handle,) = [x["add"]["rule"]["handle"] for x in out["nftables"] if "add" in x]
        return int(handle)

    def heal(self, handle: int) -> None:
        """Delete the rule :meth:`cut` added."""
        nft("delete", "rule", "inet", self.table, CHAIN, "handle", str(handle))

    def close(self) -> None:
        """Delete the table and every rule in it (idempotent)."""
        if self.made:
            self.made = False
            nft("delete", "table", "inet", self.table)


def partition(
    job: ChaosTarget,
    sched: Schedule,
    log: ChaosLog,
    busy: set[str],
    cuts: Cuts,
    cut: dict[str, tuple[int, float]],
) -> bool:
    """Cut a replica (drawn among those :func:`~.faults.ready` allows: one fault at a
    time) off for a drawn time; ``cut`` gets its name -> (the rule's handle, when to
    heal it, monotonic), which the runner honours (:func:`heal`)."""
    if job.gids is None:
        return False
    alive = ready(job, busy | set(cut))
    if alive is None:
        return False
    r = sched.pick("partition", alive)
    assert r.proc is not None
    gid = job.gids.get(r.name)
    if gid is None:
        return False  # (started before partitions were asked for: none here)
    secs = sched.partition_for()
    cut[r.name] = (cuts.cut(gid), time.monotonic() + secs)
    log.fault(
        "partition", r.name, r.proc.pid, f"partition {r.name} for {secs:.1f} s (gid {gid})",
        **where(r), gid=gid, partition_s=round(secs, 3),
    )  # fmt: skip
    return True


def heal(job: ChaosTarget, cuts: Cuts, name: str, handle: int, why: str) -> None:
    """End replica ``name``'s partition: its rule deleted, its packets flow again."""
    cuts.heal(handle)
    job.note(f"chaos: heal {name} ({why})")

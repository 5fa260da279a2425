"""``--chaos partition-every`` on one host: the grammar and the seeded draw of each
partition's length, the gids the launcher gives its replicas, the refusals, and a
real nftables rule cutting a real child process off (root with nftables only; the
launcher's run of it is in tests/integration/test_chaos_kinds.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from phalanx.config import JobConfig
from phalanx.launch.chaos import partition
from phalanx.launch.chaos.runner import check
from phalanx.launch.chaos.schedule import Schedule
from phalanx.launch.chaos.spec import Chaos
from phalanx.launch.procs import spawn, stop_all

ROOT = Path(__file__).resolve().parents[2]
CAN_CUT = partition.unavailable() is None


def test_partition_every_parses_and_draws_its_length_seeded():
    c = Chaos.parse("partition-every=4,partition-for=3,seed=5")
    assert (c.partition_every_s, c.partition_for_s, c.kinds()) == (4, 3, ["partition"])
    a, b = Schedule(c, 0.0), Schedule(c, 0.0)
    lengths = [a.partition_for() for _ in range(50)]
    assert lengths == [b.partition_for() for _ in range(50)]  # the same seed, the same draws
    assert all(1.5 <= x <= 3 for x in lengths) and len(set(lengths)) == 50
    assert (
        Schedule(Chaos.parse("partition-every=4,partition-for=3,seed=6"), 0).partition_for()
        != (lengths[0])
    )
    # partition's draws are a stream of their own: adding a kind changes none of them
    mixed = Schedule(Chaos.parse("partition-every=4,partition-for=3,kill-every=1,seed=5"), 0.0)
    mixed.pick("kill", ["policy-0", "policy-1"])
    assert mixed.next_at["partition"] == a.next_at["partition"]
    assert [mixed.partition_for() for _ in range(50)] == lengths
    assert Chaos.parse("all-every=5,partition-for=2").partition_for_s == 2
    with pytest.raises(ValueError, match="partition-for goes with partition-every or all-every"):
        Chaos.parse("kill-every=1,partition-for=2")


def test_each_replica_gets_a_gid_of_its_own_kept_across_restarts():
    gids: dict[str, int] = {}
    a = partition.gid_of(gids, "policy-0", pid=1234)
    b = partition.gid_of(gids, "rollout-0", pid=1234)
    assert partition.gid_of(gids, "policy-0", pid=1234) == a != b
    assert a == 2_000_000_000 + 1234 * 10000 + 1 and b == a + 1
    other: dict[str, int] = {}  # another launcher's run: a range of its own
    assert partition.gid_of(other, "policy-0", pid=1235) - a == 10000
    assert partition.gid_of({}, "x", pid=9999) < 2**31 - 1  # a valid gid everywhere


def test_partitions_are_refused_in_one_line_where_they_cannot_land():
    ft = JobConfig()
    if CAN_CUT:
        check(Chaos.parse("partition-every=5"), ft, {"policy": 2})
    else:
        with pytest.raises(ValueError, match="partition-every needs") as e:
            check(Chaos.parse("partition-every=5"), ft, {"policy": 2})
        assert "\n" not in str(e.value)
    if os.geteuid() == 0 and CAN_CUT:
        with pytest.raises(ValueError, match="replicas on this host") as e:
            check(Chaos.parse("partition-every=5"), ft, {"policy": 2}, launcher="ray")
        assert "--launcher ray" in str(e.value) and "\n" not in str(e.value)


def _check_in_child(euid: int, path: str) -> subprocess.CompletedProcess[str]:
    """``check`` of a partition-every run in a child process with effective uid ``euid``
    (set after its imports: root's interpreter may not be another user's to run) and
    ``PATH``."""
    code = (
        "import os\n"
        "from phalanx.config import JobConfig\n"
        "from phalanx.launch.chaos.runner import check\n"
        "from phalanx.launch.chaos.spec import Chaos\n"
        f"os.seteuid({euid})\n"
        "try:\n"
        "    check(Chaos.parse('partition-every=5'), JobConfig(), {'policy': 2})\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    env = {"PATH": path, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
        cwd="/",
    )  # fmt: skip


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to run the check as nobody)")
def test_without_root_or_without_nft_the_refusal_says_what_to_do():
    no_root = _check_in_child(65534, os.environ.get("PATH", "/usr/bin:/bin"))
    assert no_root.stdout.startswith("--chaos partition-every needs root"), no_root
    assert no_root.stdout.count("\n") == 1
    dirs = os.environ.get("PATH", "").split(":")
    path = ":".join(d for d in dirs if d and not (Path(d) / "nft").exists())  # /sbin too
    no_nft = _check_in_child(0, path)
    assert no_nft.stdout.startswith("--chaos partition-every needs nftables"), no_nft
    assert "install nftables" in no_nft.stdout and no_nft.stdout.count("\n") == 1


PROBE = """
import socket, sys
for line in sys.stdin:
    try:
        socket.create_connection(("127.0.0.1", int(line)), timeout=0.5).close()
        print("ok", flush=True)
    except OSError:
        print("cut", flush=True)
"""


@pytest.mark.skipif(not CAN_CUT, reason="needs root and nftables")
def test_a_cut_drops_the_gids_packets_until_healed_and_close_leaves_no_table(tmp_path: Path):
    """A child started as a gid of its own (``procs.spawn``, as ``phalanx run
    --no-zygote`` starts a replica) connects to a listening socket on loopback: at once
    before the cut, never (its SYNs dropped) during it, at once after the heal."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    gid = partition.gid_of({}, "policy-0")
    child = subprocess.Popen(
        [sys.executable, "-c", PROBE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, group=gid, extra_groups=[], start_new_session=True,
    )  # fmt: skip
    assert child.stdin is not None and child.stdout is not None
    stdin, stdout = child.stdin, child.stdout

    def probe() -> str:
        stdin.write(f"{port}\n")
        stdin.flush()
        return stdout.readline().strip()

    dead = subprocess.Popen(["true"])
    dead.wait()  # a launcher SIGKILLed before its finally left its table: the next removes it
    stale = partition.Cuts(dead.pid)
    partition.nft("add", "table", "inet", stale.table)
    cuts = partition.Cuts()
    try:
        assert probe() == "ok"
        handle = cuts.cut(gid)
        assert cuts.table in partition.tables() and stale.table not in partition.tables()
        assert probe() == "cut"
        cuts.heal(handle)
        assert probe() == "ok"
        cuts.cut(gid)  # cut again, and left cut: close removes it all
    finally:
        cuts.close()
        stdin.close()
        child.wait(30)
        srv.close()
    assert cuts.table not in partition.tables()
    assert (
        f"table inet {cuts.table}"
        not in subprocess.run(
            ["nft", "list", "tables"], capture_output=True, text=True, check=True
        ).stdout
    )


@pytest.mark.skipif(not CAN_CUT, reason="needs root and nftables")
def test_spawn_runs_a_replica_as_its_gid_alone(tmp_path: Path):
    gid = partition.gid_of({}, "policy-3")
    p = spawn([sys.executable, "-c", "import os; print(os.getgid(), os.getgroups())"],
              tmp_path / "log", subprocess.PIPE, gid=gid)  # fmt: skip
    assert p.stdout is not None
    out = p.stdout.read().decode()
    stop_all([p])
    assert out.split() == [str(gid), "[]"] and os.getuid() == 0

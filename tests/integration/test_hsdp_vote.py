"""The commit vote of a replica of several ranks when its leader learns during
the step that the replica was evicted: the no must be cast in the cross-replica
all-reduce, where every other replica sees it, and not only in the replica's
own vote after it (then its peers, having seen a yes, commit a step that the
evicted replica withdraws from alone: the hazard the FT manager's ``_yes``
closes for replicas of one rank). Two real processes, each a replica whose
rank 0 runs a real :class:`phalanx.train.hsdp.HSDPManager` over FSDP2 and a
real gloo group of two across them (``hsdp_vote_worker.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from phalanx.comm.torch_pg import serve_store
from phalanx.net import LOOPBACK, free_port

WORKER = Path(__file__).with_name("hsdp_vote_worker.py")


def test_a_sharded_replica_evicted_during_the_step_votes_no_where_its_peers_see_it(
    tmp_path: Path,
) -> None:
    store, address = serve_store(LOOPBACK)
    procs = []
    try:
        for index, evict in ((0, "1"), (1, "0")):
            env = {
                **os.environ,
                "RANK": "0",
                "WORLD_SIZE": "1",
                "MASTER_ADDR": LOOPBACK,
                "MASTER_PORT": str(free_port()),
            }
            out = tmp_path / f"r{index}.json"
            cmd = [sys.executable, str(WORKER), str(index), address, str(out), evict]
            procs.append(subprocess.Popen(cmd, env=env, start_new_session=True))
        for p in procs:
            assert p.wait(timeout=120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    evicted, peer = (json.loads((tmp_path / f"r{i}.json").read_text()) for i in (0, 1))
    assert evicted["votes"] == peer["votes"] == 1.0, "the evicted replica's no is in the sum"
    assert not evicted["committed"] and not peer["committed"], (evicted, peer)
    assert evicted["error"] == "evicted during the step: its peers may go on without it"
    assert peer["error"] is None, "a no of its own blames no peer"
    del store

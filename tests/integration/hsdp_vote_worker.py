"""One replica of one rank (rank 0, the leader) under a real
:class:`phalanx.train.hsdp.HSDPManager`, in a cross-replica group of two, for
``test_hsdp_vote.py``: ``python THIS INDEX STORE OUT EVICT``.

The replica's own world is one gloo rank (``MASTER_ADDR``/``MASTER_PORT`` from
the test); its model is sharded with FSDP2 on it; its cross-replica group is
a real gloo group of two built on the test's rendezvous store. The controller
is never contacted: the quorum's identity is set as ``wait_quorum`` records it.
With ``EVICT`` 1 the leader's client registers a new incarnation (what its
heartbeat thread does when it learns it was evicted) after computing and
before the gradient all-reduce. Writes JSON to OUT: whether the step committed,
the votes summed in the cross-replica all-reduce, and why it voted no."""

from __future__ import annotations

import json
import sys

import torch

from phalanx.client import ControllerClient
from phalanx.comm.torch_pg import TorchCommunicator
from phalanx.train.hsdp import HSDPManager, ReplicaRanks
from phalanx.train.shards import shard_model


def main() -> None:
    index, store, out, evict = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4] == "1"
    ranks = ReplicaRanks(30.0)
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = shard_model(plain.double(), ranks.mesh)
    client = ControllerClient("http://127.0.0.1:9", "policy", "t", token="unused")
    me = f"policy-{index}:a"
    client.replica_id, client.incarnations = me, 1
    m = HSDPManager(
        client,
        ranks,
        TorchCommunicator(30.0),
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        None,
        global_batch_size=2,
    )
    m.comm.configure(store, "policy/q1", index, 2)
    # As wait_quorum records the quorum's identity (the leader's broadcast).
    m._replica_at_quorum, m._incarnation_at_quorum, m._incarnation = me, 1, 1
    m.rank, m.world_size = index, 2
    x = torch.randn(1, 4, dtype=torch.float64)
    model(x).pow(2).sum().backward()
    if evict:
        client.replica_id, client.incarnations = f"policy-{index}:b", 2  # register()
    m.allreduce_grads(0.0)
    committed = m.should_commit()
    result = {"committed": committed, "votes": m.grads.meta[0].item(), "error": m.error}
    with open(out, "w") as f:
        json.dump(result, f)
    m.close()
    ranks.close()


if __name__ == "__main__":
    main()

"""The collective weight channel's rollout-to-rollout broadcast: a rollout replica
relays the version it fetched last to a later one, over real gloo groups (one
thread per member, each with its own channel, as separate replicas would be)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from phalanx.comm.base import CommError
from phalanx.comm.torch_pg import serve_store
from phalanx.transport.base import SyncOrder, SyncResult
from phalanx.transport.collective import CollectiveWeightChannel, fingerprint, pack


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(16, 8, generator=g),
        "head.bias": torch.randn(5, generator=g, dtype=torch.float64),
        "norm.scale": torch.randn(8, generator=g).to(torch.bfloat16),
    }


def order(seq: int, mesh_id: int, members: list[str], rank: int, store: str) -> SyncOrder:
    return SyncOrder(seq=seq, mesh_id=mesh_id, members=tuple(members), rank=rank, store=store)


def test_a_rollout_relays_the_version_it_fetched_to_a_joiner():
    leader, first, joiner = (CollectiveWeightChannel(30.0) for _ in range(3))
    _leader_store, leader_addr = serve_store()
    _first_store, first_addr = serve_store()
    w = weights(0)
    like = {k: torch.empty_like(t) for k, t in w.items()}
    reports: list[SyncResult] = []
    try:
        # 1. The policy leader sends version 2 to the first rollout replica.
        members = ["p:1", "r1:1"]
        with ThreadPoolExecutor(1) as pool:
            got = pool.submit(first.fetch, order(1, 1, members, 1, leader_addr), like)
            leader.publish(2, w, order(1, 1, members, 0, leader_addr), reports.append)
            version, fetched = got.result(60)
        assert leader.pending is not None and leader.pending.result(60).ok
        assert version == 2 and all(torch.equal(fetched[k], w[k]) for k in w)
        # 2. It relays that version to a joiner, on a mesh of its own; the leader is
        #    not part of it.
        members = ["r1:1", "r3:1"]
        with ThreadPoolExecutor(1) as pool:
            got = pool.submit(joiner.fetch, order(2, 2, members, 1, first_addr), like)
            res = first.relay(order(2, 2, members, 0, first_addr), 2)
            version, relayed = got.result(60)
        assert res.ok and res.nbytes == sum(t.numel() * t.element_size() for t in w.values())
        assert (res.seq, res.version, res.members) == (2, 2, 2)
        assert version == 2 and all(torch.equal(relayed[k], w[k]) for k in w)
        assert [r.ok for r in reports] == [True]  # the leader sent once
        # 3. The joiner kept what it got: it can relay in turn.
        assert joiner.kept is not None and joiner.kept[0] == 2
    finally:
        for ch in (leader, first, joiner):
            ch.close()


def test_a_relay_of_a_version_the_channel_does_not_keep_fails_in_words():
    ch = CollectiveWeightChannel(5.0)
    _store, addr = serve_store()
    try:
        res = ch.relay(order(3, 1, ["r1:1", "r2:1"], 0, addr), 4)
        assert not res.ok and res.nbytes == 0
        assert res.error.startswith("this replica cannot relay version 4: it keeps none")
        ch.kept = (2, 0, torch.zeros(4, dtype=torch.uint8))
        res = ch.relay(order(3, 1, ["r1:1", "r2:1"], 0, addr), 4)
        assert not res.ok and "it keeps version 2" in res.error
    finally:
        ch.close()


def test_a_joiner_with_another_model_refuses_the_relayed_weights():
    source, joiner = CollectiveWeightChannel(30.0), CollectiveWeightChannel(30.0)
    _store, addr = serve_store()
    w = weights(1)
    source.kept = (6, fingerprint(w), pack(w))  # as a fetch of version 6 leaves it
    other = {k: torch.empty(3) for k in w}
    members = ["r1:1", "r2:1"]
    try:
        with ThreadPoolExecutor(1) as pool:
            got = pool.submit(joiner.fetch, order(1, 1, members, 1, addr), other)
            assert source.relay(order(1, 1, members, 0, addr), 6).ok
            with pytest.raises(CommError, match="must match this replica's model"):
                got.result(60)
    finally:
        source.close()
        joiner.close()

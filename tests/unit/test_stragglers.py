"""Stragglers (:mod:`phalanx.controller.core.stragglers`): the weighted split of the
constant global batch, and the controller's real state machine driven by hand
through rounds whose share times come from a per-sample time per replica: a
replica at half speed is flagged after ``window`` steps and its share converges to
where every member finishes together; one too slow even at the floor is evicted,
said on the timeline, and its name rejoins at the weight it had."""

from __future__ import annotations

import pytest

from phalanx.config import ConfigError, load_config
from phalanx.controller.core.event_text import describe
from phalanx.controller.core.state import ControllerState
from phalanx.data.sampler import ElasticSampler
from phalanx.protocol.membership import Quorum
from phalanx.train.batch import share_of, split, split_weighted
from phalanx.train.share import Accumulator

B = 48


def test_equal_weights_are_the_remainder_rule():
    for batch in (0, 1, 7, 24, 97):
        for k in range(1, 7):
            for r in range(k):
                assert split_weighted(batch, (500,) * k, r) == split(batch, k, r)
                assert share_of(batch, k, r, ()) == split(batch, k, r)


@pytest.mark.parametrize("weights", [(1000, 500, 1000, 1000), (250, 1000, 7), (1, 1, 1000)])
def test_a_weighted_split_covers_the_batch_once_in_rank_order(weights):
    parts = [split_weighted(B, weights, r) for r in range(len(weights))]
    offset = 0
    for off, count in parts:
        assert off == offset
        offset += count
    assert offset == B
    # within one sample of the exact quota
    total = sum(weights)
    for (_, count), w in zip(parts, weights, strict=True):
        assert abs(count - B * w / total) < 1


def test_a_bad_weight_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^share weights must be >= 1: got 0\.$"):
        split_weighted(B, (1000, 0), 0)


@pytest.mark.parametrize("unit", [None, 4])
def test_every_member_takes_its_weighted_part_of_the_same_global_batch(unit):
    """Float shares (samples) and exact shares (whole units) alike: the members'
    shares, in rank order, are the equal split's global batch."""
    sampler = ElasticSampler(1024, seed=5)
    acc = Accumulator(None, sampler, B, unit)
    whole = [i for r in range(4) for i in acc.share(r, 4)]
    acc.weights = (1000, 1000, 1000, 500)
    parts = [acc.share(r, 4) for r in range(4)]
    assert [i for p in parts for i in p] == whole
    assert len(parts[3]) < len(parts[0])
    if unit is not None:
        assert all(len(p) % unit == 0 for p in parts)


# -- the controller ------------------------------------------------------------


def make_state(**more: object) -> ControllerState:
    opts = {"enabled": True, "window": 3, **more}
    return ControllerState(
        load_config(
            overrides=[
                "timeouts.heartbeat_s=500",
                "timeouts.quorum_s=1000",
                "roles.policy.min_replicas=1",
                "roles.policy.n_init_replicas=4",
                *(f"controller.stragglers.{k}={v}" for k, v in opts.items()),
            ]
        )
    )


class Job:
    """Four replicas; each round every member asks with the time its share of the last
    quorum took at its per-sample time (seconds)."""

    def __init__(self, st: ControllerState, per_sample: dict[str, float]):
        self.st, self.per_sample, self.t = st, per_sample, 0.0
        self.ids = {
            n: st.register("policy", n, "i0", now=0, wall=0)[0].replica_id for n in per_sample
        }
        self.q: Quorum | None = None
        self.step = 0

    def share(self, rid: str) -> int:
        if self.q is None or rid not in self.q.replica_ids:
            return 0
        ids = self.q.replica_ids
        return share_of(B, len(ids), ids.index(rid), self.q.shares)[1]

    def round(self) -> Quorum:
        self.t += 1.0
        q = None
        for name, rid in list(self.ids.items()):
            if rid not in self.st.members:
                continue
            n = self.share(rid)
            compute = (self.per_sample[name] * n, n) if n else (None, None)
            got, tick = self.st.request_quorum(
                rid, self.step, f"{rid}@{self.t}", 60.0, now=self.t, wall=self.t,
                compute_s=compute[0], samples=compute[1],
            )  # fmt: skip
            q = got or (tick.formed[-1] if tick.formed else q)  # (an eviction may form it)
        assert q is not None
        self.q, self.step = q, self.step + 1
        return q

    def times(self) -> dict[str, float]:
        return {
            n: self.per_sample[n] * self.share(rid)
            for n, rid in self.ids.items()
            if self.q and rid in self.q.replica_ids
        }


def events(st: ControllerState, kind: str) -> list[dict]:
    return [e for e in st.events if e["kind"] == kind]


def test_a_half_speed_replica_gets_half_a_share_and_all_finish_together():
    st = make_state()
    job = Job(st, {"p0": 0.01, "p1": 0.01, "p2": 0.01, "p3": 0.02})
    for _ in range(3):  # one round to get shares, then `window` reports each
        q = job.round()
        assert q.shares == ()
    calm = max(job.times().values())
    q = job.round()
    slow = job.ids["p3"]
    assert q.shares[q.replica_ids.index(slow)] == 500
    (flag,) = events(st, "straggler")
    assert flag["action"] == "flagged" and flag["replica_id"] == slow and flag["ratio"] == 2.0
    assert "flagged as a straggler (2.0x" in describe(flag)
    for _ in range(10):
        job.round()
    t = job.times()
    # best possible with 4 replicas, one at half speed: 8/7 of the calm step
    assert max(t.values()) <= 1.2 * calm, t
    assert len(events(st, "straggler")) == 1  # converged at once: no share moved since
    assert st.stragglers.figures()["flagged"] == {"policy": 1}
    assert st.stragglers.share_of(slow) == 0.5


def test_one_too_slow_at_the_floor_is_evicted_and_rejoins_at_its_share():
    st = make_state(min_share=0.25)
    job = Job(st, {"p0": 0.01, "p1": 0.01, "p2": 0.01, "p3": 0.1})
    slow = job.ids["p3"]
    for _ in range(12):
        if slow not in st.members:
            break
        job.round()
    assert slow not in st.members
    (ev,) = [e for e in events(st, "evict") if e["replica_id"] == slow]
    assert ev["detector"] == "straggler"
    assert "at the floor share (0.25 of an equal share)" in ev["reason"]
    assert "evicted by straggler" in describe(ev)
    assert st.stragglers.figures()["evicted"] == {"policy": 1}
    # its name rejoins at the floor, and is watched again
    back = st.register("policy", "p3", "i1", now=job.t, wall=job.t)[0].replica_id
    job.ids["p3"] = back
    job.per_sample["p3"] = 0.01  # recovered
    q = job.round()
    while back not in q.replica_ids:  # it joins at the next step boundary
        q = job.round()
    assert q.shares[q.replica_ids.index(back)] == 250
    for _ in range(6):
        q = job.round()
    assert q.shares == ()  # cleared: an equal split again
    assert events(st, "straggler")[-1]["action"] == "cleared"


def test_off_by_default_no_share_ever_changes():
    st = ControllerState(load_config(overrides=["roles.policy.n_init_replicas=4"]))
    job = Job(st, {"p0": 0.01, "p1": 0.01, "p2": 0.01, "p3": 0.05})
    for _ in range(8):
        assert job.round().shares == ()
    assert events(st, "straggler") == []


def test_a_retried_request_counts_once():
    st = make_state(window=2)
    job = Job(st, {"p0": 0.01, "p1": 0.01, "p2": 0.01, "p3": 0.02})
    job.round()
    rid = job.ids["p3"]
    for _ in range(3):  # the same request id, again and again
        st.stragglers.report(rid, "p3", "policy", "same", 1.0, 12, wall=0)
    assert len(st.stragglers.watches[rid].times) == 1


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [("factor", "1", "factor"), ("window", "0", "window"), ("min_share", "0", "min_share")],
)
def test_bad_straggler_settings_are_one_line(key, value, words):
    with pytest.raises(ConfigError) as e:
        load_config(overrides=[f"controller.stragglers.{key}={value}"])
    header, problem = str(e.value).split(": ", 1)  # one line: the file, then the problem
    assert "\n" not in problem
    assert header.startswith("invalid job config") and f"controller.stragglers.{words}" in problem


def test_the_peers_median_kept_sorted_is_the_median_of_the_others():
    """Each role's medians are kept sorted as reports come in (a report is a bisection,
    not a pass over thousands of peers): the peers' median read from them equals the
    median of the other members' own medians, through joins, reports and departures."""
    import random
    from statistics import median

    from phalanx.controller.core.base import ChangeLog
    from phalanx.controller.core.stragglers import Stragglers

    cfg = load_config(overrides=["controller.stragglers.enabled=true"]).controller.stragglers
    sg = Stragglers(cfg, ChangeLog(history=100))
    rng = random.Random(5)
    ids = [f"policy-{i}:x" for i in range(40)]
    for n in range(1200):
        rid = rng.choice(ids)
        if rng.random() < 0.03:
            sg.forget(rid)
            continue
        sg.report(
            rid, rid[:-2], "policy", f"q{n}", rng.uniform(0.1, 2.0), rng.randint(1, 9), wall=n
        )
        w = sg.watches[rid]
        full = [v for v in sg.watches.values() if len(v.times) >= cfg.window]
        others = [v for v in full if v is not w]
        got = sg.speeds["policy"].peers_of(w)
        if w.counted is None or not others:
            assert got is None
            continue
        assert got == (
            median(median(v.times) for v in others),
            median(median(v.rates) for v in others),
        )

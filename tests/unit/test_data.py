"""The exactly-once sampler and the constant-global-batch split."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from phalanx.data.sampler import ElasticSampler
from phalanx.train.batch import micro_batches, split


@given(st.integers(1, 1000), st.integers(1, 64))
def test_split_covers_the_batch_exactly_once(batch, world):
    taken = []
    for rank in range(world):
        off, count = split(batch, world, rank)
        taken.extend(range(off, off + count))
    assert taken == list(range(batch))


def test_remainder_rule_gives_the_first_ranks_one_more():
    # B = 10 over k = 4: q = 2, r = 2 -> ranks 0, 1 take 3; ranks 2, 3 take 2.
    assert [split(10, 4, r) for r in range(4)] == [(0, 3), (3, 3), (6, 2), (8, 2)]
    # More ranks than samples: the last ranks take nothing.
    assert [split(2, 3, r)[1] for r in range(3)] == [1, 1, 0]


def test_split_rejects_a_rank_outside_the_world():
    with pytest.raises(ValueError, match="rank must be in"):
        split(8, 2, 2)


def test_micro_batches():
    assert micro_batches(list(range(7)), 3) == [[0, 1, 2], [3, 4, 5], [6]]
    with pytest.raises(ValueError, match="micro_batch_size"):
        micro_batches([1], 0)


def test_epochs_are_permutations_deterministic_from_the_seed():
    a, b = ElasticSampler(50, seed=3), ElasticSampler(50, seed=3)
    for epoch in range(3):
        assert sorted(a.permutation(epoch)) == list(range(50))
        assert list(a.permutation(epoch)) == list(b.permutation(epoch))
    assert list(a.permutation(0)) != list(a.permutation(1))
    assert list(ElasticSampler(50, seed=4).permutation(0)) != list(a.permutation(0))


def test_global_batches_straddle_epochs_without_loss_or_duplicates():
    s = ElasticSampler(10, seed=0)
    seen = []
    for _ in range(5):  # 5 batches of 4 = 2 epochs exactly
        seen.extend(s.global_batch(4))
        s.commit(4)
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:]) == list(range(10))
    assert s.epoch == 2


@given(st.lists(st.integers(1, 5), min_size=1, max_size=30), st.integers(1, 40))
def test_committed_batches_do_not_depend_on_the_split(worlds, batch):
    """Whatever the membership at each step, the committed samples are the stream prefix."""
    s = ElasticSampler(37, seed=1)
    committed = []
    for world in worlds:
        step = []
        for rank in range(world):
            off, count = split(batch, world, rank)
            step.extend(s.positions(s.cursor + off, count))
        committed.extend(step)
        s.commit(batch)
    assert committed == ElasticSampler(37, seed=1).positions(0, batch * len(worlds))


def test_sampler_state_round_trips_and_refuses_another_dataset():
    s = ElasticSampler(20, seed=2)
    s.commit(13)
    t = ElasticSampler(20, seed=2)
    t.load_state_dict(s.state_dict())
    assert t.global_batch(5) == s.global_batch(5)
    with pytest.raises(ValueError, match="same dataset and seed"):
        ElasticSampler(21, seed=2).load_state_dict(s.state_dict())


def test_empty_dataset_is_refused():
    with pytest.raises(ValueError, match="num_samples must be > 0"):
        ElasticSampler(0)

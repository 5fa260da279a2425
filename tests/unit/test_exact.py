"""The exact sum (:mod:`phalanx.train.exact`): the same bits whatever the membership,
whoever holds which term and in whatever order the group reduces; its precision
against float64 and against a float32 sum; its handling of overflow, NaN and Inf.

The property test runs k members as threads of one in-process group whose
collectives add the members up in a random order (``groups.py``); the last test
runs the same sums over real gloo groups."""

from __future__ import annotations

import math

import pytest
import torch
from groups import Hub
from hypothesis import given, settings
from hypothesis import strategies as st
from rank_threads import run_ranks, run_threads

from phalanx.comm.torch_pg import TorchCommunicator
from phalanx.train import exact
from phalanx.train.exact import (
    FRACTION_BITS,
    MAX_TERMS,
    ExactSum,
    Outcome,
    Term,
    TooManyTerms,
    from_fixed,
    to_fixed,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def exchange(
    k: int, owner: list[int], terms: list[Term], like: list[torch.Tensor], seed: int = 0
) -> tuple[list[list[torch.Tensor]], list[Outcome], Hub]:
    """Member ``owner[j]`` of ``k`` holds term ``j``; every member's output and outcome."""
    hub = Hub(k, seed)
    comms = hub.comms()
    outs = [[torch.full_like(t, 7.0) for t in like] for _ in range(k)]
    got: list[Outcome | None] = [None] * k

    def body(r: int) -> None:
        mine = [t for j, t in enumerate(terms) if owner[j] == r]
        got[r] = ExactSum().allreduce(comms[r], mine, outs[r])

    run_threads(k, body, on_error=lambda e: hub.barrier.abort())
    return outs, [g for g in got if g is not None], hub


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.element_size() == 4 else torch.int64)


@st.composite
def sums(draw: st.DrawFn) -> tuple[list[Term], list[torch.Tensor]]:
    """Terms of random sizes and magnitudes (zeros, subnormal-small, large)."""
    shapes = draw(st.lists(st.integers(1, 40), min_size=1, max_size=3))
    n = draw(st.integers(1, 10))
    seed = draw(st.integers(0, 2**31))
    g = torch.Generator().manual_seed(seed)
    terms = []
    for _ in range(n):
        tensors = []
        for numel in shapes:
            scale = 10.0 ** draw(st.sampled_from([-40, -12, -3, 0, 3, 20]))
            t = torch.randn(numel, generator=g) * scale
            if draw(st.booleans()):
                t[torch.rand(numel, generator=g) < 0.3] = 0.0
            tensors.append(t)
        terms.append(Term(tensors, float(torch.randn((), generator=g, dtype=torch.float64))))
    return terms, [torch.empty(s) for s in shapes]


@given(sums(), st.data())
@settings(max_examples=40, deadline=None)
def test_any_membership_and_assignment_gives_the_same_bits(case, data) -> None:
    terms, like = case
    (calm,), (alone,), _ = exchange(1, [0] * len(terms), terms, like)
    k = data.draw(st.integers(1, 5), label="members")
    owner = data.draw(
        st.lists(st.integers(0, k - 1), min_size=len(terms), max_size=len(terms)), label="owner"
    )
    outs, got, hub = exchange(k, owner, terms, like, seed=data.draw(st.integers(0, 99)))
    assert hub.collectives == 2  # the exponents' MAX, then the sums with the vote
    for out, o in zip(outs, got, strict=True):
        assert o == Outcome(k, alone.loss)
        for a, b in zip(out, calm, strict=True):
            assert torch.equal(bits(a), bits(b))


def test_precision_beats_a_float32_sum_and_stays_within_the_stated_bound() -> None:
    g = torch.Generator().manual_seed(1)
    n, numel = 64, 4096
    terms = [Term([torch.randn(numel, generator=g)]) for _ in range(n)]
    (out,), _, _ = exchange(1, [0] * n, terms, [torch.empty(numel)])
    ref = sum(t.tensors[0].double() for t in terms)
    f32 = torch.zeros(numel)
    for t in terms:
        f32 += t.tensors[0]
    err, err32 = (out[0].double() - ref).abs(), (f32.double() - ref).abs()
    top = max(float(t.tensors[0].abs().max()) for t in terms)
    e = math.frexp(top)[1]
    # Every term rounded to 2**(e - F), then the sum rounded once to float32.
    bound = n * 2.0 ** (e - FRACTION_BITS - 1) + ref.abs() * 2.0**-24
    assert bool((err <= bound).all())
    assert float(err.max()) < float(err32.max()) and float(err.mean()) < float(err32.mean())


def test_a_single_term_comes_back_whole_down_to_2_to_the_minus_22_of_its_largest() -> None:
    t = torch.tensor([3.0e5, -1.2345678e3, 7.0e-2, 2.0**-5, 0.0, -1e-30])
    (out,), _, _ = exchange(1, [0], [Term([t])], [torch.empty(6)])
    near = t.abs() >= t.abs().max() * 2.0**-22
    assert torch.equal(out[0][near], t[near])
    assert float(out[0][-1]) == 0.0  # below 2**-47 of the largest: flushed


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_other_dtypes_sum_alike_whoever_holds_the_terms(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    terms = [Term([torch.randn(33, generator=g).to(dtype)]) for _ in range(6)]
    like = [torch.empty(33, dtype=dtype)]
    (alone,), _, _ = exchange(1, [0] * 6, terms, like)
    outs, _, _ = exchange(3, [2, 0, 1, 1, 0, 2], terms, like, seed=5)
    for out in outs:
        assert out[0].dtype == dtype and torch.equal(out[0], alone[0])
    ref = sum(t.tensors[0].double() for t in terms)
    torch.testing.assert_close(alone[0].double(), ref, rtol=2 * torch.finfo(dtype).eps, atol=0)


def test_all_zero_buckets_and_members_without_terms() -> None:
    terms = [Term([torch.zeros(4), torch.ones(2)], 0.0)]
    outs, got, _ = exchange(3, [1], terms, [torch.empty(4), torch.empty(2)])
    for out, o in zip(outs, got, strict=True):
        assert torch.equal(out[0], torch.zeros(4)) and torch.equal(out[1], torch.ones(2))
        assert o.loss == 0.0 and o.votes == 3


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_nonfinite_element_anywhere_is_known_to_every_member_after_the_first_collective(
    bad: float,
) -> None:
    terms = [Term([torch.ones(3)], 1.0) for _ in range(4)]
    terms[2].tensors[0][1] = bad
    outs, got, hub = exchange(3, [0, 1, 2, 0], terms, [torch.empty(3)])
    assert hub.collectives == 1  # no sum is taken
    for out, o in zip(outs, got, strict=True):
        assert o.nonfinite and o.votes == 0 and math.isnan(o.loss)
        assert torch.equal(out[0], torch.full((3,), 7.0)), "outputs must be left as they were"
    # A non-finite loss alone is refused alike.
    _, got, _ = exchange(
        2, [0, 1], [Term([torch.ones(1)], 1.0), Term([torch.ones(1)], bad)], [torch.empty(1)]
    )
    assert all(o.nonfinite for o in got)


def test_the_headroom_holds_the_largest_terms_at_the_largest_count() -> None:
    e = 0
    largest = math.nextafter(2.0**e, 0.0)  # every |x| < 2**e
    q = to_fixed(largest, e)
    assert q == 2**FRACTION_BITS  # the rounding reaches 2**F
    assert MAX_TERMS * q <= 2**62 < 2**63 - 1
    assert from_fixed(MAX_TERMS * q, e) == MAX_TERMS * 2.0**e


def test_more_terms_than_the_headroom_holds_are_refused(monkeypatch) -> None:
    monkeypatch.setattr(exact, "MAX_TERMS", 3)
    terms = [Term([torch.ones(2)]) for _ in range(4)]
    with pytest.raises(TooManyTerms, match=r"at most 3 terms .* got 4"):
        exchange(2, [0, 1, 0, 1], terms, [torch.empty(2)])


def test_real_gloo_groups_of_any_size_give_the_same_bits() -> None:
    g = torch.Generator().manual_seed(3)
    terms = [Term([torch.randn(1000, generator=g) * 10.0**i], float(i)) for i in range(-3, 4)]
    results: dict[int, list[torch.Tensor]] = {}
    for k in (1, 2, 3):
        comms = [TorchCommunicator(30.0) for _ in range(k)]
        outs = [[torch.empty(1000)] for _ in range(k)]

        def body(r: int, comms=comms, outs=outs, k=k) -> None:
            mine = [t for j, t in enumerate(terms) if (j * 5 + 1) % k == r]
            o = ExactSum().allreduce(comms[r], mine, outs[r])
            assert o.votes == k and o.loss == sum(t.loss for t in terms)

        run_ranks(comms, f"exact-{k}", body)
        for out in outs:
            assert torch.equal(out[0], outs[0][0])
        results[k] = outs[0]
    assert torch.equal(results[1][0], results[2][0]) and torch.equal(results[1][0], results[3][0])

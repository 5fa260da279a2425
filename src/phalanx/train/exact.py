"""Bit-exact sums over a group: fixed point against a shared exponent, summed as int64.

A float sum depends on the order of its terms, and the order of a gradient's
terms changes with membership: which replica computed which micro-batch, how
many replicas there are, and how the all-reduce walks the group. An integer sum
does not: it is exact, so it is associative. This module turns a float sum into
an integer one (``train.exact_reduction``, docs/architecture.md, "Bit-exact
reduction"):

1. Each *term* (one micro-batch's gradient, bucket by bucket, with its loss)
   gives each bucket an exponent ``e``: the ``frexp`` exponent of its largest
   magnitude, so that every ``|x| < 2**e``.
2. One MAX all-reduce of the exponents over the group (exact): ``E`` per
   bucket, the same on every member whoever holds which term.
3. Every term is converted to ``q = round(x * 2**(F - E))`` (half to even;
   ``F`` = :data:`FRACTION_BITS`) and the terms are added as int64 (exact).
4. One SUM all-reduce of the int64 buckets (exact, in any order), with the
   commit vote, the fixed-point loss and the number of terms in the same
   collective (on a patient communicator the vote is an op of its own after
   the buckets, as :class:`~phalanx.train.grads.GradBuffer` does).
5. Converted back once: ``q * 2**(E - F)``, in the bucket's dtype.

The result is a function of the multiset of terms alone.

**Bits.** An int64 holds a sign, :data:`HEADROOM_BITS` of headroom and ``F``
fraction bits: each ``|q| <= 2**F`` (the rounding may reach it), so the sum of
at most :data:`MAX_TERMS` terms is ``<= 2**62``. No overflow is possible within
that bound; the number of terms travels with the sum and a larger one is
refused (:class:`TooManyTerms`) rather than wrapped.

**Precision.** Each term is rounded to ``2**(E - F)``: an error of at most
``2**(E - F - 1)``, below ``2**-46`` of the bucket's largest magnitude. The
sum adds no error, and the conversion back rounds once, to the dtype. A float32
sum rounds each addition to 2**-24 of its partial sum, so the fixed-point sum is
the more accurate one for every element within ``2**-22`` of its bucket's
largest magnitude; an element smaller than that keeps an absolute error below
``N * 2**-47`` of that largest magnitude (``N`` terms), and one below
``2**-47`` of it is flushed to zero.

**NaN and Inf** cannot be fixed point. A bucket with one gets the exponent
:data:`NONFINITE`, which wins the MAX: every member learns it from the first
collective and the exchange stops there, with no sum (:attr:`Outcome.nonfinite`).

Who calls :meth:`ExactSum.allreduce`: every member of the group, once per
exchange, with its own terms (none is allowed) and outputs of the same shapes,
dtypes and order. Failure: :class:`~phalanx.comm.base.CommError` from either
collective; the terms are left as they were (a retry can reuse them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from phalanx.comm.base import Communicator

FRACTION_BITS = 46
"""F: bits of a term below its bucket's exponent."""
HEADROOM_BITS = 16
"""Bits above ``F`` for the carries of the sum: 1 + 16 + 46 + 1 (a rounded term may
reach ``2**F``) = 64."""
MAX_TERMS = 1 << HEADROOM_BITS
"""Most terms (micro-batches of one step, over the whole group) one sum may take."""
ZERO = -(1 << 30)
"""The exponent of a bucket whose every element is zero (it loses every MAX)."""
NONFINITE = 1 << 30
"""The exponent of a bucket holding a NaN or an Inf (it wins every MAX)."""
_STEP = 100
"""Largest power of two multiplied in at once: 2**100 is a float32 (2**128 is not)."""


class TooManyTerms(ValueError):
    """A sum took more than :data:`MAX_TERMS` terms: it may have overflowed."""


@dataclass
class Term:
    """One term of an exact sum: a micro-batch's tensors (one per output bucket, with
    its shape) and its loss."""

    tensors: Sequence[torch.Tensor]
    loss: float = 0.0


@dataclass
class Outcome:
    votes: int
    """How many members voted yes (0 when :attr:`nonfinite`: no vote was taken)."""
    loss: float
    """The exact sum of every term's loss (NaN when :attr:`nonfinite`)."""
    nonfinite: bool = False
    """Some member's term held a NaN or an Inf: the outputs were not written."""


def exponent(t: torch.Tensor) -> torch.Tensor:
    """The exponent of ``t``'s largest magnitude (a 0-dim int64 on ``t``'s device):
    every ``|x| < 2**exponent``; :data:`ZERO` when all are zero (or ``t`` is empty),
    :data:`NONFINITE` when one is NaN or infinite. No host sync."""
    if t.numel() == 0:
        return torch.tensor(ZERO, dtype=torch.int64, device=t.device)
    lo, hi = torch.aminmax(t.detach())
    top = torch.maximum(hi, -lo)  # NaN propagates
    wide = top.to(torch.float64 if t.dtype == torch.float64 else torch.float32)
    e = torch.frexp(wide).exponent.to(torch.int64)
    e = torch.where(wide == 0, torch.full_like(e, ZERO), e)
    return torch.where(torch.isfinite(wide), e, torch.full_like(e, NONFINITE))


def scalar_exponent(x: float) -> int:
    """:func:`exponent` of one Python float."""
    if not math.isfinite(x):
        return NONFINITE
    return ZERO if x == 0 else math.frexp(x)[1]


def to_fixed(x: float, e: int) -> int:
    """``round(x * 2**(F - e))`` (half to even) of one Python float, exactly."""
    return 0 if e == ZERO else round(math.ldexp(x, FRACTION_BITS - e))


def from_fixed(q: int, e: int) -> float:
    """``q * 2**(e - F)`` as a Python float (rounded once, to float64)."""
    return 0.0 if e == ZERO else math.ldexp(float(q), e - FRACTION_BITS)


def ldexp_(x: torch.Tensor, k: int) -> torch.Tensor:
    """``x *= 2**k`` in place, in steps whose factor the dtype can hold. Exact
    wherever the result is a normal number: a power of two changes only the exponent."""
    while k:
        step = max(-_STEP, min(_STEP, k))
        x.mul_(2.0**step)
        k -= step
    return x


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The float a term is scaled in: float64 for float64, else float32 (a scaled
    term reaches 2**46, past what float16 holds)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class ExactSum:
    """The exchange of the module doc, with its buffers kept from one step to the
    next (the int64 sums and a scratch per dtype and device): a replica allocates
    them once."""

    def __init__(self) -> None:
        self._sums: list[torch.Tensor] = []
        self._scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        """Scratch by dtype and device, the largest bucket's size: a float for the
        scaled term, an int64 for its integer (fresh memory every step would be
        page-faulted in every step)."""
        self.bytes_sent = 0
        """Bytes this member handed to the collectives so far (exponents, sums, meta)."""

    def allreduce(
        self,
        comm: Communicator,
        terms: Sequence[Term],
        out: Sequence[torch.Tensor],
        vote: bool = True,
    ) -> Outcome:
        """Write the exact sum over the group of every member's ``terms`` into ``out``
        (same shapes and dtypes on every member); see the module doc for the contract."""
        for term in terms:
            if len(term.tensors) != len(out) or any(
                t.shape != o.shape for t, o in zip(term.tensors, out, strict=True)
            ):
                raise ValueError(
                    f"a term of an exact sum must have one tensor per output, of its shape: "
                    f"got {[tuple(t.shape) for t in term.tensors]}, expected "
                    f"{[tuple(o.shape) for o in out]}."
                )
        exps = self._exponents(comm, terms, len(out))
        if NONFINITE in exps:
            return Outcome(0, float("nan"), nonfinite=True)
        sums = self._buffers(out)
        for b, (s, e) in enumerate(zip(sums, exps, strict=False)):
            self._add_terms(s, [term.tensors[b] for term in terms], e)
        loss = sum(to_fixed(term.loss, exps[-1]) for term in terms)
        meta = torch.tensor([int(vote), loss, len(terms)], dtype=torch.int64, device=comm.device)
        if comm.patient:
            comm.allreduce(sums, "sum")
            comm.allreduce([meta], "sum")
        else:
            comm.allreduce([*sums, meta], "sum")
        self.bytes_sent += sum(s.numel() for s in sums) * 8 + meta.numel() * 8
        votes, loss_q, count = (int(v) for v in meta.tolist())
        if count > MAX_TERMS:
            raise TooManyTerms(
                f"an exact sum must take at most {MAX_TERMS} terms (micro-batches): got "
                f"{count}. Raise the micro-batch size so that a step has fewer."
            )
        for o, s, e in zip(out, sums, exps, strict=False):
            self._restore(o, s, e)
        return Outcome(votes, from_fixed(loss_q, exps[-1]))

    def _exponents(self, comm: Communicator, terms: Sequence[Term], n: int) -> list[int]:
        """Every bucket's exponent over the group, then the loss's (one MAX all-reduce)."""
        local = torch.full((n + 1,), ZERO, dtype=torch.int64, device=comm.device)
        for term in terms:
            if term.tensors:
                mine = torch.stack([exponent(t).to(comm.device) for t in term.tensors])
                local[:n] = torch.maximum(local[:n], mine)
        local[n] = max((scalar_exponent(term.loss) for term in terms), default=ZERO)
        comm.allreduce([local], "max")
        self.bytes_sent += local.numel() * 8
        return [int(e) for e in local.tolist()]

    def _buffers(self, out: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if [(s.shape, s.device) for s in self._sums] != [(o.shape, o.device) for o in out]:
            self._sums = [torch.empty(o.shape, dtype=torch.int64, device=o.device) for o in out]
        return self._sums

    def _scratch_for(self, like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        key = (dtype or _work_dtype(like.dtype), like.device)
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < like.numel():
            buf = self._scratch[key] = torch.empty(like.numel(), dtype=key[0], device=key[1])
        return buf[: like.numel()].view(like.shape)

    def _add_terms(self, acc: torch.Tensor, tensors: list[torch.Tensor], e: int) -> None:
        """``acc = sum(round(t * 2**(F - e)))`` over ``tensors`` (zero if none)."""
        if e == ZERO or not tensors:
            acc.zero_()  # (every term of the group is zero in this bucket)
            return
        k = FRACTION_BITS - e
        first = max(-_STEP, min(_STEP, k))
        q = self._scratch_for(acc, torch.int64) if len(tensors) > 1 else acc
        for i, t in enumerate(tensors):
            x = self._scratch_for(t)
            # Exact: |t| < 2**e, so |x| < 2**F, a normal number, or below 2**-126
            # and rounded to 0 either way.
            if t.dtype == x.dtype:
                ldexp_(torch.mul(t, 2.0**first, out=x), k - first).round_()
            else:  # (float16, bfloat16: scaled in float32)
                ldexp_(x.copy_(t), k).round_()
            if i == 0:
                acc.copy_(x)
            else:
                q.copy_(x)
                acc.add_(q)

    def _restore(self, out: torch.Tensor, acc: torch.Tensor, e: int) -> None:
        """``out = acc * 2**(e - F)``, rounded once to ``out``'s dtype."""
        if e == ZERO:
            out.zero_()
        elif out.dtype in (torch.float32, torch.float64):
            ldexp_(out.copy_(acc), e - FRACTION_BITS)
        else:
            out.copy_(ldexp_(acc.to(torch.float32), e - FRACTION_BITS))

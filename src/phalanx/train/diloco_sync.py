"""Synchronous DiLoCo over the FT manager's process group: a quorum per outer
round, and a round commits everywhere or nowhere.

A round is ``H`` inner steps on the round's ``H * B`` samples (``B`` =
``train.global_batch_size``; inner step ``h`` takes samples ``[hB, (h+1)B)``
of the round, split over the quorum with the FT-DDP remainder rule), with
the exchanges that fall in it (one per fragment), then a commit vote::

    wait_quorum()                heal joiners (model, inner optimizer, outer state)
    snapshot                     the round's starting state, for a retry
    H x (inner step, exchanges)  each exchange: all-reduce over the quorum
    vote()                       every participant got through the round
    commit, or restore           the snapshot, and retry with the next quorum

So the controller's step of a DiLoCo job counts committed outer rounds; a
replica killed mid-round makes the survivors' exchange fail, they restore
the round's start and run it again without it (the data of a round is
consumed once, by the round that commits). A joiner heals at the start of a
round, then takes part in it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.comm.base import CommError, Communicator, Pending
from phalanx.comm.compress import Compression, decode, encode, wire_bytes
from phalanx.comm.transfer import flatten, unflatten
from phalanx.train.base import NonFiniteGradient
from phalanx.train.batch import micro_batches, split
from phalanx.train.diloco import DiLoCo, DiLoCoConfig
from phalanx.train.exact import ExactSum, Term
from phalanx.train.manager import Compute, Manager


class CollectiveReducer:
    """A DiLoCo :class:`~phalanx.train.diloco.Reducer` over a communicator (the
    FT manager's: the current quorum's process group).

    Uncompressed: one all-reduce (sum, in the pseudo-gradient's dtype: fp32
    or fp64) of the fragment, divided by the quorum size. Compressed: every
    rank's encoded fragment is all-gathered and decoded, and summed in rank
    order in fp32, so every rank computes the same bits. ``exact``: the sum is
    :mod:`phalanx.train.exact`'s (each replica's pseudo-gradient one term), so
    it does not depend on the members' order either; uncompressed only.

    Who calls: every participant of the quorum, in the same order of rounds
    and fragments. Failure: raises :class:`CommError` (peer died or hung);
    :class:`~phalanx.train.base.NonFiniteGradient` on every participant when a
    pseudo-gradient held a NaN or an Inf under ``exact``."""

    def __init__(self, comm: Communicator, compression: Compression = "none", exact: bool = False):
        if exact and compression != "none":
            raise ValueError(
                f"an exact DiLoCo exchange must be uncompressed: got compression={compression!r}."
            )
        self.comm, self.compression = comm, compression
        self.exact = ExactSum() if exact else None
        self.bytes_sent = 0
        self.wait_s = 0.0
        """Seconds this replica spent blocked on its exchanges (all of an exchange
        without overlap; only what τ inner steps did not hide with it)."""

    def start(self, tensors: list[torch.Tensor], *, round: int, fragment: int) -> _Started | _Done:
        """Start the fragment's exchange, to finish at :meth:`_Started.wait` (Streaming
        DiLoCo's overlap: :class:`~phalanx.train.diloco.Overlapping`). Uncompressed and
        inexact only; a compressed or exact exchange runs now (its all-gather and its
        two collectives are not started asynchronously)."""
        if self.exact is not None or self.compression != "none":
            return _Done(self, self.average(tensors, round=round, fragment=fragment))
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self.bytes_sent += flat.numel() * flat.element_size()
        return _Started(self, self.comm.allreduce_start([flat], "sum"), flat, tensors)

    def average(
        self, tensors: list[torch.Tensor], *, round: int, fragment: int
    ) -> tuple[list[torch.Tensor], int]:
        t0 = time.perf_counter()
        try:
            return self._average(tensors, round=round, fragment=fragment)
        finally:
            self.wait_s += time.perf_counter() - t0

    def _average(
        self, tensors: list[torch.Tensor], *, round: int, fragment: int
    ) -> tuple[list[torch.Tensor], int]:
        comm, k = self.comm, self.comm.world_size
        if self.exact is not None:
            out = [torch.empty_like(t) for t in tensors]
            sent = self.exact.bytes_sent
            summed = self.exact.allreduce(comm, [Term(tensors)], out)
            self.bytes_sent += self.exact.bytes_sent - sent
            if summed.nonfinite:
                raise NonFiniteGradient(
                    f"DiLoCo round {round}, fragment {fragment}: a pseudo-gradient must be "
                    "finite to be summed exactly: one held a NaN or an Inf."
                )
            return [o.div_(k) for o in out], k
        if self.compression == "none":
            flat = torch.cat([t.reshape(-1) for t in tensors])
            comm.allreduce([flat], "sum")
            self.bytes_sent += flat.numel() * flat.element_size()
            flat.div_(k)
            out, off = [], 0
            for t in tensors:
                out.append(flat[off : off + t.numel()].view_as(t))
                off += t.numel()
            return out, k
        acc = [
            torch.zeros_like(t, dtype=torch.promote_types(t.dtype, torch.float32)) for t in tensors
        ]
        for i, t in enumerate(tensors):
            wire = encode(t.detach(), self.compression)
            names = sorted(wire)
            packed = torch.cat([wire[n].reshape(-1).view(torch.uint8) for n in names])
            self.bytes_sent += wire_bytes(wire)
            for got in comm.allgather(packed):
                parts, off = {}, 0
                for n in names:
                    v = wire[n]
                    nb = v.numel() * v.element_size()
                    # clone: a slice may sit at an offset its dtype cannot view (int8 before fp32)
                    parts[n] = got[off : off + nb].clone().view(v.dtype).view_as(v)
                    off += nb
                acc[i] += decode(parts, self.compression, t).to(acc[i].dtype)
        return [(a / k).to(t.dtype) for a, t in zip(acc, tensors, strict=True)], k


class _Started:
    """An uncompressed exchange in flight: the sum lands in ``flat``."""

    def __init__(
        self,
        reducer: CollectiveReducer,
        pending: Pending,
        flat: torch.Tensor,
        like: list[torch.Tensor],
    ):
        self.reducer, self.pending, self.flat, self.like = reducer, pending, flat, like
        self.k = reducer.comm.world_size

    def wait(self) -> tuple[list[torch.Tensor], int]:
        t0 = time.perf_counter()
        try:
            self.pending.wait()
        finally:
            self.reducer.wait_s += time.perf_counter() - t0
        self.flat.div_(self.k)
        out, off = [], 0
        for t in self.like:
            out.append(self.flat[off : off + t.numel()].view_as(t))
            off += t.numel()
        return out, self.k


class _Done:
    """An exchange that already ran."""

    def __init__(self, reducer: CollectiveReducer, result: tuple[list[torch.Tensor], int]):
        self.result = result

    def wait(self) -> tuple[list[torch.Tensor], int]:
        return self.result


def clone_tree(tree: Any) -> Any:
    """A deep copy of a state tree (tensors cloned)."""
    skeleton, tensors = flatten(tree)
    return unflatten(skeleton, [t.detach().clone() for t in tensors])


@dataclass
class RoundResult:
    committed: bool
    round: int
    """Committed rounds after this call (the controller's step)."""
    loss: float | None
    """Mean inner loss over the round's samples (only when committed)."""
    participants: int
    quorum_id: int
    healed: bool = False
    error: str | None = None
    seconds: float = 0.0
    samples: list[int] | None = None
    """This replica's samples in the round, in inner-step order."""


class SyncDiLoCo:
    """The synchronous DiLoCo loop of one replica.

    ``manager`` must have been built with ``global_batch_size = H * B`` (the
    samples of one round) and the inner optimizer; the outer state is
    registered with it (heal and checkpoints carry it). ``exact``: the outer
    all-reduce is an exact sum (``train.exact_reduction``, :class:`CollectiveReducer`).

    Who calls: every replica, :meth:`train_round` once per loop iteration,
    until ``manager.step`` reaches the job's rounds. Not thread-safe."""

    def __init__(
        self,
        manager: Manager,
        cfg: DiLoCoConfig,
        inner_batch_size: int,
        *,
        outer_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
        exact: bool = False,
    ):
        if manager.global_batch_size != cfg.H * inner_batch_size:
            raise ValueError(
                f"the manager's global batch must be H * B = {cfg.H * inner_batch_size} "
                f"samples (one outer round): got {manager.global_batch_size}."
            )
        self.manager, self.cfg, self.B = manager, cfg, inner_batch_size
        self.reducer = CollectiveReducer(manager.comm, cfg.compression, exact)
        self.diloco = DiLoCo(manager.model, cfg, self.reducer, outer_factory)
        manager.register_state("diloco", self.diloco.state_dict, self.diloco.load_state_dict)

    def train_round(self, fn: Compute, *, last: bool = False) -> RoundResult:
        """One outer round: quorum (and heal), H inner steps with their exchanges,
        commit vote. ``last``: also flush Streaming exchanges (``finish``) so that
        every replica ends identical. On ``committed=False`` the replica is back
        at the round's start; call again."""
        m, t0 = self.manager, time.perf_counter()
        m.start_quorum()
        q = m.wait_quorum()
        healed = m.client.replica_id in q.heal
        snapshot = clone_tree(m.state_dict()) if m.ok else None
        loss, samples = 0.0, []
        if m.ok:
            try:
                for h in range(self.cfg.H):
                    idx = self._inner_share(h)
                    samples += idx
                    loss += self._inner_step(fn, idx)
                    self.diloco.after_inner_step()
                    m.client.report_progress(inner_step=self.diloco.inner_steps)  # live, dashboard
                # Exchanges still running (the round's last step's) end before the
                # vote: one that fails must fail this round, not a committed one.
                self.diloco.settle()
                if last:
                    self.diloco.finish()
            except CommError as e:
                m.fail(e)
        total = m.vote(loss)
        committed = m.should_commit()
        if not committed and snapshot is not None:
            m.load_state_dict(snapshot)
        m.client.report_progress(inner_step=self.diloco.inner_steps)  # back if undone
        return RoundResult(
            committed,
            m.step,
            total / m.global_batch_size if committed else None,
            m.world_size,
            q.quorum_id,
            healed,
            None if committed else (m.error or "a participant voted no"),
            time.perf_counter() - t0,
            samples,
        )

    def _inner_share(self, h: int) -> list[int]:
        m = self.manager
        if m.sampler is None:
            raise RuntimeError("SyncDiLoCo needs the manager's sampler: build it with one.")
        off, count = split(self.B, m.world_size, m.rank)
        return m.sampler.positions(m.sampler.cursor + h * self.B + off, count)

    def _inner_step(self, fn: Compute, idx: list[int]) -> float:
        """One local optimizer step on ``idx`` (the replica's mean loss)."""
        m = self.manager
        m.grads.zero()
        total = 0.0
        for mb in micro_batches(idx, m.micro_batch_size):
            total += float(fn(mb, 1.0 / max(1, len(idx))))
        if idx:
            m.optimizer.step()
        return total

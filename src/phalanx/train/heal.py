"""The joiner's side of a live heal: a receive buffer faulted in ahead of time.

A joiner receives the whole state (model, optimizer, step, sampler, RNG) into
memory it has never touched, and on a fast wire the first-touch page faults
cost about as much as the transfer. So while it waits for its first quorum
(up to one step of the survivors), the manager fills a buffer of the size the
heal will need (:class:`PrefaultedBuffer`) and hands it to ``recv_state``.

The size comes from the joiner's own state. Its model has the sender's shapes,
but its optimizer has no state before its first step: the per-parameter slots
an optimizer keeps are estimated from :data:`OPTIMIZER_SLOTS`. A buffer that
turns out short is not used (the heal then receives into new memory, as
without it); one that is long keeps its slack for as long as the received
optimizer state lives, so the estimate errs by at most one slot.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from phalanx.comm.transfer import (
    ALIGN,
    aligned,
    buffer_bytes,
    faulted_buffer,
    flatten,
    recv_state,
    send_state,
)
from phalanx.protocol.quorum import QuorumView

OPTIMIZER_SLOTS = {
    "Adam": 2,
    "AdamW": 2,
    "NAdam": 2,
    "RAdam": 2,
    "Adamax": 2,
    "Adadelta": 2,
    "RMSprop": 1,
    "SGD": 1,
    "Adagrad": 0,  # its state exists from the constructor on
}
"""Tensors the size of the parameter that each optimizer keeps per parameter,
besides a scalar step. Others count as 2."""


def optimizer_slots(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> int:
    name = type(optimizer).__name__
    slots = OPTIMIZER_SLOTS.get(name, 2)
    if group.get("amsgrad"):
        slots += 1  # max_exp_avg_sq
    if name == "SGD" and not group.get("momentum"):
        slots = 0
    if name == "RMSprop":
        slots += bool(group.get("momentum")) + bool(group.get("centered"))
    return slots


def expected_state_bytes(state: Any, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the heal buffer for ``state`` (what ``Manager.state_dict()``
    returns) once ``optimizer`` has stepped: the state as it is, plus the
    optimizer state of every parameter that has none yet."""
    total = buffer_bytes(state)
    for group in optimizer.param_groups:
        slots = optimizer_slots(optimizer, group)
        if not slots:
            continue
        for p in group["params"]:
            if p in optimizer.state or not p.requires_grad:
                continue
            total += slots * aligned(p.numel() * p.element_size()) + ALIGN  # + step
    return total


def received_into(tree: Any, scratch: torch.Tensor | None) -> bool:
    """Whether ``recv_state`` put ``tree``'s tensors into ``scratch``."""
    if scratch is None:
        return False
    ptr = scratch.untyped_storage().data_ptr()
    _, tensors = flatten(tree)
    return any(t.untyped_storage().data_ptr() == ptr for t in tensors)


def heal_record(
    sd: Any,
    scratch: torch.Tensor | None,
    healer: str,
    step: int,
    t0: float,
    times: dict[str, float],
) -> dict[str, Any]:
    """What a finished heal reports (``Manager.last_heal``): ``seconds`` from ``t0``
    (perf_counter) to now, of which ``wait_s`` waiting for the healer to send (it
    learns of the heal with its quorum) and ``transfer_s`` the transfer itself
    (``times`` from :func:`~phalanx.comm.transfer.recv_state`); the state's bytes;
    ``warm``: received into the pre-faulted buffer; ``started_at`` and
    ``received_at``: the transfer's ends as wall-clock times (comparable across
    the processes of a host)."""
    now, wall = time.perf_counter(), time.time()
    return {
        "seconds": now - t0,
        "from": healer,
        "step": step,
        "warm": received_into(sd, scratch),
        "bytes": buffer_bytes(sd),
        "wait_s": times["started"] - t0,
        "transfer_s": times["received"] - times["started"],
        "started_at": wall - (now - times["started"]),
        "received_at": wall - (now - times["received"]),
    }


class PrefaultedBuffer:
    """Fills a buffer in a background thread; :meth:`take` hands it over once."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="phalanx-prefault")
        self._fut: Future[torch.Tensor] | None = None

    def start(self, nbytes: int) -> None:
        if self._fut is None and nbytes > 0:
            self._fut = self._pool.submit(faulted_buffer, nbytes)

    def take(self) -> torch.Tensor | None:
        """The buffer (waiting for it if it is still being filled), or None."""
        fut, self._fut = self._fut, None
        return fut.result() if fut is not None else None

    def drop(self) -> None:
        """Not needed after all (no heal): let it go."""
        self._fut = None

    def close(self) -> None:
        self._fut = None
        self._pool.shutdown(wait=False, cancel_futures=True)


def prefault_if_joining(m: Any) -> None:
    """A :class:`~phalanx.train.manager.Manager` that cannot predict its share (a
    joiner, or rejoining) may be healed with its next quorum: fill its receive
    buffer meanwhile (every rank of a replica of several, each for its shard)."""
    if m.predicted_share() is None:
        m._heal_buffer.start(expected_state_bytes(m.state_dict(), m.optimizer))


def heal_in_quorum(m: Any, q: QuorumView, me: str | None) -> None:
    """The heals of quorum ``q`` that concern ``me`` (a :class:`~phalanx.train.manager.
    Manager`'s replica, as it took the quorum): receive its own state from its
    source, and send its state to each replica it heals."""
    ranks = {rid: i for i, rid in enumerate(q.replica_ids)}
    if me in q.heal:
        t0 = time.perf_counter()
        src = ranks[q.heal[me]]
        scratch = m._heal_buffer.take()
        times: dict[str, float] = {}
        sd = recv_state(m.comm, src, tag=1, scratch=scratch, times=times)
        m.load_state_dict(sd)
        m.heals += 1
        m.last_heal = heal_record(sd, scratch, q.heal[me], m.step, t0, times)
        dt = m.last_heal["seconds"]
        m.client.report_heal(q.heal[me], m.step, round(dt, 4), q.quorum_id)
        m.log.info(
            "healed from %s to step %d in %.3f s (%d bytes, into %s memory)",
            q.heal[me],
            m.step,
            dt,
            m.last_heal["bytes"],
            "pre-faulted" if m.last_heal["warm"] else "new",
        )
    for lag, healer in sorted(q.heal.items()):
        if healer == me:
            send_state(m.comm, m.state_dict(), ranks[lag], tag=1)

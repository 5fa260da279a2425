"""DiLoCo and Streaming DiLoCo: the outer loop, with the papers' symbols.

DiLoCo (Douillard et al., arXiv 2311.08105): each of k replicas runs H inner
steps of its own optimizer (AdamW, lr 4e-4, weight decay 0.1), then all
replicas take one *outer* step on the averaged pseudo-gradient

    Δ = mean over replicas of (θ_global - θ_local)
    θ_global ← OuterOpt(θ_global, Δ)      # Nesterov SGD, outer lr 0.7, momentum 0.9
    θ_local  ← θ_global

so replicas communicate once every H steps instead of every step.

Streaming DiLoCo (Douillard et al., arXiv 2501.18512): the parameters are
split into p fragments, synchronised in turn (fragment j at inner steps
t ≡ j·H/p mod H), so the bytes in flight at any time are 1/p of the model.
With an overlap delay τ > 0, the averaged Δ of a fragment synchronised at
step t is applied at step t + τ (the exchange overlaps τ inner steps), and
the local fragment is merged as θ_local ← alpha·θ_local + (1 - alpha)·θ_global
(mixing factor alpha; alpha = 0 takes the global value).

This module is the math only. The exchange is a :class:`Reducer`: over the FT
manager's process group, or through an object store
(``phalanx.transport.diloco_rounds``). Each call says who must call it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from phalanx.comm.compress import Compression


@dataclass(frozen=True)
class DiLoCoConfig:
    """Outer-loop settings (the papers' symbols and defaults)."""

    H: int = 50
    """Inner steps per outer step (``sync_every``)."""
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True
    fragments: int = 1
    """p: parameter fragments synchronised in turn (Streaming DiLoCo); 1 is DiLoCo."""
    tau: int = 0
    """τ: inner steps between a fragment's exchange and applying its result."""
    alpha: float = 0.0
    """alpha: mixing of the local fragment with the new global one when applied."""
    compression: Compression = "none"
    """Wire format of pseudo-gradients; always accumulated in fp32 (or fp64)."""

    def __post_init__(self) -> None:
        if self.H < 1:
            raise ValueError(f"DiLoCo H must be >= 1: got {self.H}.")
        if self.fragments < 1 or self.H % self.fragments:
            raise ValueError(
                f"DiLoCo H must be divisible by fragments: got H={self.H}, "
                f"fragments={self.fragments}. Pick fragments among the divisors of H."
            )
        if not 0 <= self.tau < self.H // self.fragments:
            raise ValueError(
                f"DiLoCo tau must be in [0, H/fragments): got tau={self.tau}, "
                f"H/fragments={self.H // self.fragments}. An exchange must land before the "
                f"fragment's next one starts."
            )
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"DiLoCo alpha must be in [0, 1]: got {self.alpha}.")
        if self.outer_lr <= 0 or not 0 <= self.outer_momentum < 1:
            raise ValueError(
                f"DiLoCo outer_lr must be > 0 and outer_momentum in [0, 1): got "
                f"{self.outer_lr}, {self.outer_momentum}."
            )


class Reducer(Protocol):
    """Averages one fragment's pseudo-gradient over the round's replicas.

    Who calls: every replica taking part in the outer round, with tensors of
    the same shapes, in the same order of rounds and fragments. Returns the
    average (same shapes and dtypes) and the number of replicas averaged."""

    def average(
        self, tensors: list[torch.Tensor], *, round: int, fragment: int
    ) -> tuple[list[torch.Tensor], int]: ...


class Exchange(Protocol):
    """A fragment's exchange started and not yet finished (:meth:`Overlapping.start`):
    :meth:`wait` returns what :meth:`Reducer.average` would have."""

    def wait(self) -> tuple[list[torch.Tensor], int]: ...


@runtime_checkable
class Overlapping(Protocol):
    """A :class:`Reducer` that can start an exchange and finish it later, so that it
    runs behind the next τ inner steps (Streaming DiLoCo's overlap). Same contract
    as :meth:`Reducer.average`, the failure included, raised by :meth:`Exchange.wait`."""

    def start(self, tensors: list[torch.Tensor], *, round: int, fragment: int) -> Exchange: ...


def fragment_of(names: list[str], fragments: int) -> list[list[int]]:
    """Parameter indices of each fragment: contiguous runs of the parameter list
    (layers stay together), balanced by count."""
    n = len(names)
    if fragments > n:
        raise ValueError(
            f"DiLoCo fragments must be <= the number of parameters: got {fragments} > {n}."
        )
    bounds = [round(i * n / fragments) for i in range(fragments + 1)]
    return [list(range(bounds[j], bounds[j + 1])) for j in range(fragments)]


class DiLoCo:
    """The outer loop of one replica.

    Who calls: every replica, :meth:`after_inner_step` once after each inner
    optimizer step (same count on every replica; joiners take the count from
    heal state). Not thread-safe. Failure: if the reducer raises, the round's
    fragment is not applied and the exception propagates; the replica's
    global copy and outer momentum are untouched, so the round can be retried.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        cfg: DiLoCoConfig,
        reducer: Reducer,
        outer_factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None = None,
    ):
        self.model, self.cfg, self.reducer = model, cfg, reducer
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        # θ_global: the last synchronised parameters (accumulated in at least fp32).
        self.global_params = [
            p.detach().to(torch.promote_types(p.dtype, torch.float32)).clone() for p in self.params
        ]
        for g in self.global_params:
            g.requires_grad_(True)
        make = outer_factory or self._nesterov
        self.outer = make(self.global_params)
        self.frags = fragment_of(self.names, cfg.fragments)
        self.inner_steps = 0
        self.rounds = 0
        self.pending: dict[int, tuple[int, list[torch.Tensor] | Exchange]] = {}
        """fragment -> (apply at inner step, averaged Δ, or the exchange still running)
        while an exchange overlaps."""

    def _nesterov(self, params: list[torch.Tensor]) -> torch.optim.Optimizer:
        c = self.cfg
        return torch.optim.SGD(
            params,
            lr=c.outer_lr,
            momentum=c.outer_momentum,
            nesterov=c.nesterov and c.outer_momentum > 0,
        )

    def offset(self, fragment: int) -> int:
        """Inner step (mod H) at which ``fragment`` is exchanged."""
        return fragment * self.cfg.H // self.cfg.fragments

    def due(self, t: int) -> list[int]:
        """Fragments exchanged at inner step ``t``."""
        h = self.cfg.H
        return [
            j
            for j in range(self.cfg.fragments)
            if t % h == self.offset(j) % h and t >= max(self.offset(j), 1)
        ]

    def exchanges(self, steps: int) -> list[tuple[int, int]]:
        """``(round, fragment)`` of every exchange of a run of ``steps`` inner
        steps from the start, in order, :meth:`finish`'s included: what an
        aggregator that takes no part (``phalanx syncer``) must serve."""
        out, rounds, p = [], 0, self.cfg.fragments
        for t in range(1, steps + 1):
            for j in self.due(t):
                out.append((rounds, j))
                rounds += 1 if j == p - 1 else 0
        for j in range(p):
            if steps % self.cfg.H != self.offset(j) % self.cfg.H or self.cfg.tau:
                out.append((rounds, j))
        return out

    def after_inner_step(self) -> list[int]:
        """Count one inner step; exchange and apply what is due. Returns the
        fragments exchanged at this step."""
        self.inner_steps += 1
        t = self.inner_steps
        for j, (at, avg) in list(self.pending.items()):
            if at == t:
                del self.pending[j]
                self._apply(j, _result(avg))
        done = self.due(t)
        for j in done:
            self._exchange(j)
        return done

    def fast_forward(
        self,
        result: Callable[[list[torch.Tensor], int, int], list[torch.Tensor] | None],
        limit: int,
    ) -> int:
        """Catch up without training: apply the outer steps of exchanges the
        other replicas already made, in order, while ``result(like, round,
        fragment)`` has them (None: not decided yet, or gone), up to inner
        step ``limit``. Then the local parameters restart from θ_global (the
        replica's own unsynchronised progress is dropped). Returns the inner
        steps skipped. Who calls: a replica that restarted or fell behind, in
        the decoupled mode, before its next inner step."""
        start = self.inner_steps
        while True:
            t = next((u for u in range(self.inner_steps + 1, limit + 1) if self.due(u)), None)
            if t is None:
                break
            # Fragment offsets differ mod H: one fragment is due at a step.
            (j,) = self.due(t)
            avg = result(self.pseudo_gradient(j), self.rounds, j)
            if avg is None:
                break
            # (Names of their own: the fragment fetched above is applied below.)
            for k, (at, waiting) in sorted(self.pending.items()):
                if at <= t:
                    del self.pending[k]
                    self._apply(k, _result(waiting), mix=False)
            self.inner_steps = t
            self.rounds += 1 if j == self.cfg.fragments - 1 else 0
            if self.cfg.tau:
                self.pending[j] = (t + self.cfg.tau, avg)
            else:
                self._apply(j, avg, mix=False)
        with torch.no_grad():
            for p, g in zip(self.params, self.global_params, strict=True):
                p.copy_(g.detach().to(p.dtype))
        return self.inner_steps - start

    def finish(self) -> None:
        """End of training: apply exchanges in flight, then exchange every fragment
        not exchanged at this very step, with no overlap, so that every replica
        ends with the same parameters. Same contract as :meth:`after_inner_step`."""
        for j, (_, avg) in sorted(self.pending.items()):
            self._apply(j, _result(avg))
        self.pending.clear()
        t = self.inner_steps
        for j in range(self.cfg.fragments):
            if t % self.cfg.H != self.offset(j) % self.cfg.H or self.cfg.tau:
                avg, _ = self.reducer.average(
                    self.pseudo_gradient(j), round=self.rounds, fragment=j
                )
                self._apply(j, avg, mix=False)

    def pseudo_gradient(self, fragment: int) -> list[torch.Tensor]:
        """Δ_local of a fragment: θ_global - θ_local (in the global copy's dtype)."""
        return [
            self.global_params[i].detach() - self.params[i].detach().to(self.global_params[i].dtype)
            for i in self.frags[fragment]
        ]

    def settle(self) -> None:
        """Wait for every exchange still running (its result is still applied at its
        step): a synchronous round's commit vote must not come before its exchanges
        are done, or a failure would surface after the round committed. Who calls:
        every replica, at the same point (the end of a round)."""
        for j, (at, avg) in list(self.pending.items()):
            self.pending[j] = (at, _result(avg))

    def _exchange(self, fragment: int) -> None:
        delta = self.pseudo_gradient(fragment)
        r = self.reducer
        if self.cfg.tau and isinstance(r, Overlapping):
            # Streaming DiLoCo's overlap: the exchange runs behind the next τ inner
            # steps, and its result is applied at the step it would be anyway.
            started = r.start(delta, round=self.rounds, fragment=fragment)
            self.rounds += 1 if fragment == self.cfg.fragments - 1 else 0
            self.pending[fragment] = (self.inner_steps + self.cfg.tau, started)
            return
        avg, _ = r.average(delta, round=self.rounds, fragment=fragment)
        self.rounds += 1 if fragment == self.cfg.fragments - 1 else 0
        if self.cfg.tau:
            self.pending[fragment] = (self.inner_steps + self.cfg.tau, avg)
        else:
            self._apply(fragment, avg)

    def _apply(self, fragment: int, avg: list[torch.Tensor], mix: bool = True) -> None:
        """θ_global ← OuterOpt(θ_global, Δ) on the fragment, then merge the local copy."""
        idx = set(self.frags[fragment])
        for g in self.global_params:
            g.grad = None
        for i, d in zip(self.frags[fragment], avg, strict=True):
            self.global_params[i].grad = d.to(self.global_params[i].dtype)
        # Only this fragment's parameters have a grad: SGD skips the others
        # (their momentum buffers are left as they are).
        self.outer.step()
        a = self.cfg.alpha if self.cfg.tau and mix else 0.0
        with torch.no_grad():
            for i in idx:
                new = self.global_params[i].detach().to(self.params[i].dtype)
                if a:
                    self.params[i].mul_(a).add_(new, alpha=1 - a)
                else:
                    self.params[i].copy_(new)
            for i in idx:
                self.global_params[i].grad = None

    # -- heal and checkpoint state ---------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Outer state: θ_global, the outer optimizer, counters and any exchange
        still in flight (waited for first). Goes with heal and with checkpoints."""
        self.settle()
        return {
            "global": {n: g.detach() for n, g in zip(self.names, self.global_params, strict=True)},
            "outer": self.outer.state_dict(),
            "inner_steps": self.inner_steps,
            "rounds": self.rounds,
            "pending": {str(j): {"at": at, "avg": avg} for j, (at, avg) in self.pending.items()},
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        missing = [n for n in self.names if n not in sd["global"]]
        if missing:
            raise ValueError(
                f"DiLoCo state must hold every parameter's global copy: missing {missing[:3]}. "
                f"It comes from another model."
            )
        with torch.no_grad():
            for n, g in zip(self.names, self.global_params, strict=True):
                g.copy_(sd["global"][n])
        self.outer.load_state_dict(sd["outer"])
        self.inner_steps = int(sd["inner_steps"])
        self.rounds = int(sd["rounds"])
        self.pending = {int(j): (int(v["at"]), list(v["avg"])) for j, v in sd["pending"].items()}


def _result(avg: list[torch.Tensor] | Exchange) -> list[torch.Tensor]:
    """A pending fragment's averaged Δ: as it is, or once its exchange is done."""
    return avg if isinstance(avg, list) else avg.wait()[0]

"""The replay draw: which of a replay's entries a batch trains again.

Both the controller's ledger (:mod:`phalanx.controller.core.ledger.replay`, when
it freezes a batch) and a job without a controller (``rl_single``) draw a batch's
replayed rollouts with :func:`positions`, so one job file and seed draw the same
entries whichever of them runs it. It is pure (no clock, no ``random``): the
controller's core draws nothing unseeded.
"""

from __future__ import annotations

import hashlib

__all__ = ["positions"]


def positions(seed: int, index: int, n: int, k: int) -> list[int]:
    """``min(k, n)`` distinct positions in ``range(n)``, uniform, from (``seed``,
    ``index``) alone: a partial Fisher-Yates shuffle whose i-th swap is drawn from
    SHA-256 of ``seed:index:i`` (256 bits modulo ``n - i``: no visible bias)."""
    swapped: dict[int, int] = {}
    out = []
    for i in range(min(k, n)):
        h = hashlib.sha256(f"{seed}:{index}:{i}".encode()).digest()
        j = i + int.from_bytes(h, "big") % (n - i)
        out.append(swapped.get(j, j))
        swapped[j] = swapped.get(i, i)
    return sorted(out)

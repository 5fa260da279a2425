"""phalanx: elastic, fault-tolerant training and RL post-training.

Your own training loop, fault tolerant: :class:`phalanx.Replica` (see
:mod:`phalanx.replica`). Imported lazily, so that ``phalanx --help`` and the
controller do not pay for torch.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Replica", "__version__"]

if TYPE_CHECKING:
    from phalanx.replica import Replica


def __getattr__(name: str) -> Any:
    if name == "Replica":
        from phalanx.replica import Replica

        return Replica
    raise AttributeError(f"module 'phalanx' has no attribute {name!r}")

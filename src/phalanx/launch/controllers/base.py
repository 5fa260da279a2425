"""What a launcher needs of its job's controllers, one or several."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from phalanx.launch.supervise import ControllerProcess


class Controllers(Protocol):
    """Who calls: the launcher's thread alone.

    - :meth:`start` once: start them and wait until they answer; returns :attr:`url`.
      Raises :class:`~phalanx.launch.supervise.ControllerDown` when they cannot start.
    - :meth:`check` often: restart one that exited; a line for the operator when
      something happened, else None. Raises ``ControllerDown`` once one keeps failing.
    - :meth:`stop` at the end, also after a failed start.
    """

    @property
    def url(self) -> str | None:
        """Where they answer (several: comma-separated)."""
        ...

    @property
    def restarts(self) -> int:
        """Controller processes restarted after they exited, in all."""
        ...

    @property
    def target(self) -> str:
        """What a replica is given as ``--controller``."""
        ...

    def members(self) -> list[ControllerProcess]:
        """Each controller process (one, or each of a group), in start order: what
        ``--chaos controller-kill-every`` draws from."""
        ...

    def start(self) -> str: ...

    def check(self) -> str | None: ...

    def stop(self) -> None: ...

"""The replica side of the controller's protocol.

- ``transport.py``  where the controller is, the job token, one typed call with retries
- ``replica.py``    :class:`ControllerClient`: membership, quorum, commands, the RL ledger
- ``liveness.py``   the heartbeat and lifeline threads, and the progress they carry
- ``members.py``    the cache of quorum member lists, fetched once per change of membership
"""

from phalanx.client.liveness import LIFELINE_HOLD_S
from phalanx.client.members import DigestMismatch
from phalanx.client.replica import ControllerClient
from phalanx.client.transport import (
    CertificateMismatch,
    ControllerError,
    ControllerUnreachable,
    Evicted,
    QuorumTimeout,
    Rejected,
    Transport,
    find_token,
    resolve,
)

__all__ = [
    "LIFELINE_HOLD_S",
    "CertificateMismatch",
    "ControllerClient",
    "ControllerError",
    "ControllerUnreachable",
    "DigestMismatch",
    "Evicted",
    "QuorumTimeout",
    "Rejected",
    "Transport",
    "find_token",
    "resolve",
]

"""What a node's agent tells the controller: that a replica's worker failed.

The agent deregisters the replica's live incarnation(s) itself, so that the
quorum moves on at once instead of after a heartbeat timeout (the third
failure detector of DESIGN.md). A controller that cannot be reached is only
logged: heartbeats then detect the failure as before.
"""

from __future__ import annotations

from phalanx.client import ControllerError, Evicted, Transport, find_token, resolve
from phalanx.protocol.base import OkReply
from phalanx.protocol.membership import DeregisterReq
from phalanx.protocol.status import Status


def controller_problem(controller: str | None) -> str | None:
    """Why exits could not be reported to ``controller`` (no token, no URL), or None."""
    if not controller:
        return None
    try:
        find_token(resolve(controller)[1])
    except ControllerError as e:
        return str(e)
    return None


def report_exit(controller: str, name: str, reason: str) -> tuple[list[str], str | None]:
    """Deregister every live incarnation of replica ``name`` with ``reason``. Returns
    the replica ids found and the error that stopped the report, if any. The
    controller finds nothing when the workers left by themselves (or never
    registered)."""
    ids: list[str] = []
    try:
        t = Transport(controller, unreachable_timeout_s=5.0)
        try:
            st = t.call("/v1/status", None, Status, timeout=5.0)
            ids = [
                m.replica_id for role in st.roles.values() for m in role.replicas if m.name == name
            ]
            for rid in ids:
                try:
                    req = DeregisterReq(replica_id=rid, reason=reason[:1000])
                    t.call("/v1/deregister", req, OkReply, timeout=5.0)
                except Evicted:
                    pass  # gone meanwhile: nothing left to report
        finally:
            t.close()
    except ControllerError as e:
        return ids, str(e)
    return ids, None

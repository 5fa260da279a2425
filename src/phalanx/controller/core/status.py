"""The job's status document (``GET /v1/status``): the records as the core keeps
them, and the dashboard's overview (:mod:`.overview`). Read-only, no I/O."""

from __future__ import annotations

from typing import TYPE_CHECKING

from phalanx.controller.core.overview import overview
from phalanx.protocol.status import Status

if TYPE_CHECKING:
    from phalanx.controller.core.state import ControllerState


def status_of(st: ControllerState, now: float, wall: float | None = None) -> Status:
    roles = {}
    for name, rs in st.roles.items():
        last = rs.last_quorum
        roles[name] = {
            **rs.meta(),
            "config": rs.cfg.model_dump(),
            "pending": sorted(rs.pending),
            "quorum": last,
            "replicas": [
                {
                    **m.record(),
                    "seconds_since_heartbeat": round(now - m.last_seen, 3),
                    "suspect": m.suspect_since is not None,
                    "commands_pending": st.commands.count(m.replica_id),
                }
                for m in sorted(st.alive(name), key=lambda m: m.replica_id)
            ],
            "desired": st.desired.get(name),
        }
    cks = st.checkpoints.records
    return Status.model_validate(
        {
            "epoch": st.epoch,
            "job_id": st.cfg.job.id,
            "roles": roles,
            "events": st.events[-100:],
            "checkpoints": {"latest": st.checkpoints.latest, "committed": cks[-10:]},
            "rl": st.ledger.status() if st.ledger is not None else None,
            "overview": overview(st, now, wall),
        },
        strict=False,  # built here: lists stand for tuples
    )

"""Command routes and the operator's actions (the dashboard, the CLI)."""

from __future__ import annotations

from phalanx.controller.core.overview import steps_per_s
from phalanx.controller.http.base import Api, Route
from phalanx.protocol.commands import (
    AckReply,
    AckReq,
    CheckpointReply,
    CheckpointReq,
    CommandsReply,
    DrainReq,
    EnqueueReq,
    EvictReply,
    EvictReq,
    PollReq,
    ScaleReply,
    ScaleReq,
    TriggerCheckpointReply,
    TriggerCheckpointReq,
)


async def poll(api: Api, req: PollReq) -> CommandsReply:
    """This replica's unacknowledged commands with an id above ``after``; held up to
    ``wait_s`` when there is none."""
    st = api.state
    cmds = st.pending_commands(req.replica_id, req.after)
    if not cmds and await api.service.wait("commands", req.replica_id, req.wait_s):
        cmds = st.pending_commands(req.replica_id, req.after)
    return CommandsReply.model_construct(**api.envelope(), commands=cmds)


async def ack(api: Api, req: AckReq) -> AckReply:
    """Acknowledge commands once acted on. Idempotent."""
    missing = api.state.ack(req.replica_id, list(req.ids))
    api.service.commit()
    return AckReply(**api.envelope(), not_pending=missing)


async def enqueue(api: Api, req: EnqueueReq) -> CommandsReply:
    """Queue a command for a replica id, or for every live replica of a role."""
    cmds = api.service.apply(api.state.enqueue, req.target, req.kind, dict(req.payload))
    api.service.metrics.commands.labels(req.kind).inc(len(cmds))
    return CommandsReply.model_construct(**api.envelope(), commands=cmds)


async def scale(api: Api, req: ScaleReq) -> ScaleReply:
    """Ask for ``replicas`` replicas of ``role``; a launcher that can start and stop
    replicas follows it."""
    desired = api.service.apply(api.state.set_desired, req.role, req.replicas)
    return ScaleReply(**api.envelope(), desired=desired)


async def checkpoint(api: Api, req: CheckpointReq) -> CheckpointReply:
    """A replica committed a checkpoint; the status's ``checkpoints`` lists it."""
    rec = api.service.apply(
        api.state.record_checkpoint, req.replica_id, req.step, req.url, req.nbytes
    )
    return CheckpointReply.model_construct(**api.envelope(), checkpoint=rec)


async def evict(api: Api, req: EvictReq) -> EvictReply:
    """Evict a replica now. A live process registers again as a new incarnation."""
    api.service.apply(api.state.evict_replica, req.replica_id, req.reason)
    return EvictReply(**api.envelope(), evicted=req.replica_id)


async def drain(api: Api, req: DrainReq) -> CommandsReply:
    """Queue a ``drain`` command: the replica leaves at its next step boundary."""
    cmds = api.service.apply(api.state.drain_replica, req.replica_id)
    api.service.metrics.commands.labels("drain").inc(len(cmds))
    return CommandsReply.model_construct(**api.envelope(), commands=cmds)


async def trigger_checkpoint(api: Api, req: TriggerCheckpointReq) -> TriggerCheckpointReply:
    """Ask the policy replicas to checkpoint a step a little ahead (a ``checkpoint``
    command, honoured by FT-DDP replicas with ``[checkpoint] url`` set)."""
    st, lead = api.state, req.lead_steps
    if lead is None and "policy" in st.roles:
        lead = max(2, round(2 * steps_per_s(st.roles["policy"], api.service.clock())))
    cmds = api.service.apply(st.request_checkpoint, lead or 2)
    api.service.metrics.commands.labels("checkpoint").inc(len(cmds))
    step = cmds[0].payload["step"] if cmds else None
    return TriggerCheckpointReply(**api.envelope(), step=step, replicas=len(cmds))


ROUTES = [
    Route("/v1/commands/poll", poll, PollReq, CommandsReply),
    Route("/v1/commands/ack", ack, AckReq, AckReply),
    Route("/v1/commands", enqueue, EnqueueReq, CommandsReply),
    Route("/v1/scale", scale, ScaleReq, ScaleReply),
    Route("/v1/checkpoints", checkpoint, CheckpointReq, CheckpointReply),
    Route("/v1/replicas/evict", evict, EvictReq, EvictReply),
    Route("/v1/replicas/drain", drain, DrainReq, CommandsReply),
    Route(
        "/v1/checkpoints/trigger", trigger_checkpoint, TriggerCheckpointReq, TriggerCheckpointReply
    ),
]

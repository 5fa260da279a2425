"""Membership routes: register, heartbeat, lifeline, quorum and its members, failure
reports, deregister."""

from __future__ import annotations

import time
import uuid

from phalanx.controller.core.base import StateError
from phalanx.controller.http.base import Api, Route
from phalanx.net import connect
from phalanx.protocol.base import OkReply, Reply
from phalanx.protocol.membership import (
    DeregisterReq,
    HeartbeatReply,
    HeartbeatReq,
    LifelineReq,
    QuorumReply,
    QuorumReq,
    RegisterReply,
    RegisterReq,
    ReportReply,
    ReportReq,
)
from phalanx.protocol.quorum import MembersReply, MembersReq

REACH_S = 2.0
"""How long the controller tries to connect to a registering replica's address."""


async def check_reachable(address: str) -> None:
    """Refuse a replica whose advertised address (its rendezvous store, which its
    peers connect to for heals and weight syncs) the controller cannot connect to:
    one line naming it, at registration, instead of a collective that hangs later.
    (A replica that serves no store advertises '' and is not checked.)"""
    if not address:
        return
    try:
        await connect(address, REACH_S)
    except (OSError, ValueError, TimeoutError) as e:
        why = "no answer" if isinstance(e, TimeoutError) else (str(e) or type(e).__name__)
        raise StateError(
            f"address {address!r} must be reachable by the controller and the replica's "
            f"peers: connecting to it failed ({why}). Set --advertise-host (or "
            f"$PHALANX_ADVERTISE_HOST) to an address of the replica's host that they can reach.",
            field="address",
            status=422,
        ) from None


async def register(api: Api, req: RegisterReq) -> RegisterReply:
    """Register a new incarnation of a replica (a live older one of the same name is
    evicted). The reply carries the timeouts the replica must keep."""
    st = api.state
    if api.service.check_addresses:
        await check_reachable(req.address)
    member = api.service.apply(
        st.register,
        req.role,
        req.name,
        uuid.uuid4().hex[:8],
        ranks=req.ranks,
        tp=req.tp,
        address=req.address,
        capabilities=dict(req.capabilities),
        step=req.step,
        state_root=req.state_root,
        root_id=req.root_id,
    )
    t = st.cfg.timeouts
    return RegisterReply(
        **api.envelope(),
        replica_id=member.replica_id,
        heartbeat_interval_s=t.heartbeat_interval_s,
        heartbeat_timeout_s=t.heartbeat_s,
        suspect_grace_s=t.suspect_grace_s,
        quorum_timeout_s=t.quorum_s,
    )


async def heartbeat(api: Api, req: HeartbeatReq) -> bytes:
    """Report liveness and progress; held up to ``wait_s`` (at most the heartbeat
    interval) and answered at once with ``probe`` when a peer suspects the replica."""
    svc, st = api.service, api.state
    healed = req.healed.model_dump() if req.healed is not None else None
    svc.apply(
        st.heartbeat,
        req.replica_id,
        step=req.step,
        loss=req.loss,
        inner_step=req.inner_step,
        healed=healed,
    )
    svc.metrics.heartbeats.inc()
    if req.healed is not None:
        svc.metrics.heal_seconds.observe(req.healed.seconds)
    wait = min(req.wait_s, st.cfg.timeouts.heartbeat_interval_s)
    woken = wait > 0 and await svc.wait("heartbeat", req.replica_id, wait)
    m = st.members.get(req.replica_id)
    if m is None:
        st.member(req.replica_id)  # raises 410: evicted while we waited
    probe = woken and m is not None and m.suspect_since is not None
    return api.once(("heartbeat", probe), lambda: HeartbeatReply(**api.envelope(), probe=probe))


async def lifeline(api: Api, req: LifelineReq) -> bytes:
    """Held open by a replica for as long as it lives (re-posted every ``wait_s``):
    when the connection drops with no reply, the process died, and the replica is
    suspected at once (``timeouts.suspect_on_disconnect``). Unlike the held
    heartbeat, it is held almost all the time, whatever the replica's heartbeat
    thread is doing. Ends early if the replica leaves."""
    api.state.member(req.replica_id)  # 410 when not a member
    await api.service.wait("lifeline", req.replica_id, req.wait_s)
    return api.once("lifeline", lambda: Reply(**api.envelope()))


async def quorum(api: Api, req: QuorumReq) -> QuorumReply | bytes:
    """Ask to take part in the role's next quorum at ``step``; held up to ``wait_s``.
    ``pending``: ask again with the same ``request_id``."""
    svc, st = api.service, api.state
    t0 = time.monotonic()
    q = svc.apply(
        st.request_quorum,
        req.replica_id,
        req.step,
        req.request_id,
        req.timeout_s,
        lineage=req.lineage,
        compute_s=req.compute_s,
        samples=req.samples,
    )
    deadline = t0 + req.wait_s
    while q is None:
        st.member(req.replica_id)  # 410 if evicted (a straggler: by this very request)
        left = deadline - time.monotonic()
        if left <= 0 or not await svc.wait("quorum", req.replica_id, left):
            break
        st.member(req.replica_id)  # raises 410 if evicted while waiting
        q = st.answer(req.replica_id, req.request_id)
    if q is None:
        return QuorumReply.model_construct(**api.envelope(), status="pending", quorum=None)
    svc.metrics.quorum_waited(q.role, time.monotonic() - t0)
    # A brief of a few hundred bytes, whatever N: the member list is fetched apart,
    # once per change (members below). Sending all N members to each of N replicas
    # every round was O(N^2) bytes a round (docs/benchmarks.md, "Controller").
    return api.rosters.reply(q, req.replica_id)


async def members(api: Api, req: MembersReq) -> bytes:
    """The member list of a quorum this controller answered (one of the role's last
    few), in rank order, or its difference from a list the replica holds (``have``).
    A replica calls it when a quorum brief names a digest it does not hold: once per
    change of membership. 404 (no longer kept) or 409 (another digest): ask for the
    quorum again."""
    body, kind = api.rosters.members(api.state, req)
    api.service.metrics.member_lists.labels(kind).inc()
    return body


async def report_failure(api: Api, req: ReportReq) -> ReportReply:
    """A peer saw a collective error: each suspect is probed, and evicted unless it
    heartbeats within ``suspect_grace_s``."""
    st = api.state
    unknown = api.service.apply(
        st.report_failure,
        req.reporter,
        list(req.suspects),
        reason=req.reason,
        failed_commit=req.failed_commit,
    )
    api.service.metrics.reports.inc()
    return ReportReply(**api.envelope(), unknown=unknown)


async def deregister(api: Api, req: DeregisterReq) -> OkReply:
    """Leave the job for good."""
    api.service.apply(api.state.deregister, req.replica_id, req.reason)
    return OkReply(**api.envelope(), ok=True)


ROUTES = [
    Route("/v1/register", register, RegisterReq, RegisterReply),
    Route("/v1/heartbeat", heartbeat, HeartbeatReq, HeartbeatReply, held=True),
    Route("/v1/lifeline", lifeline, LifelineReq, Reply, held=True),
    Route("/v1/quorum", quorum, QuorumReq, QuorumReply, held=True),
    Route("/v1/quorum/members", members, MembersReq, MembersReply),
    Route("/v1/report-failure", report_failure, ReportReq, ReportReply),
    Route("/v1/deregister", deregister, DeregisterReq, OkReply),
]
FAST = ("/v1/heartbeat", "/v1/quorum", "/v1/lifeline", "/v1/quorum/members")
"""The hot routes, answered by the server's HTTP protocol itself
(:mod:`phalanx.controller.http.hot`)."""

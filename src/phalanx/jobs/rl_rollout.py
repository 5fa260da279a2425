"""A rollout replica of an RL job: lease prompts, generate, score, submit.

The loop, between two generation batches:

1. ask the controller for a prompt lease, declaring the weights version held
   (long-poll; the reply may carry a weight-sync order instead of, or with,
   a lease);
2. if a sync order names this replica, join it first and swap the weights
   (:class:`WeightChannel`; streamed into an engine that can roll back a cut
   stream, each tensor loaded as it arrives: :func:`fetch_into`), then report
   the version now held; or, named the
   order's source (rank 0: a later replica needs the version this one holds),
   relay the weights it fetched last to the order's other members;
3. generate ``group_size`` completions per leased prompt with the engine
   (keyed by the job seed and the prompt's index, so that a prompt dispatched
   again regenerates the same completions under the same weights), score
   them with the task (:func:`phalanx.rl.generate.make_rollouts`), and submit
   them against the lease. With the default rollout store, the controller's,
   the completions ride in the submission; with a store outside the
   controller (``rl.transport.rollouts``: Redis, storage) they are put there
   first and only their refs are submitted. Every rollout carries the
   version that made it.

**In-flight weight updates.** An engine that takes them
(``engine.inflight_updates``: the HF engine) registers the capability
``inflight_updates``, and the controller then names it in a sync order even
while it holds a lease. Between two chunks of a generation (``rl.engine.chunk``
tokens) the replica asks the controller whether an order names it
(``ControllerClient.sync_poll``, answered at once) and takes it there: the
tokens after it carry the new version (``Completion.versions``), and each
rollout's version is the oldest of its tokens'. With the collective channel
every member must rendezvous, and a generating replica joins only at its next
chunk boundary: ``rl.loop.sync_timeout_s`` must cover one chunk's time (plus
the scoring and submit of a lease that just ended). Storage and Redis channels
are pulls and need nothing more. A load that fails part-way leaves the engine
at version -1 and the engine abandons the batch (EngineError): those
completions are not submitted, and the lease's prompts are dispatched again
when it expires.

A replica that joins a running job holds no weights (version -1) and gets
no prompts until a sync has brought it to the current version; at the very
start (nothing trained yet) it builds version 0 itself from the model
config, exactly as the policy did. A replica killed mid-lease loses
nothing: the controller dispatches its prompts again once it is evicted or
the lease's deadline passes.

An operator's ``drain`` (:mod:`phalanx.train.orders`) is honoured between
two generation batches: after the last batch was submitted and the next
lease reply (with any weight sync it orders) was taken, the replica prints
``done`` with ``drained`` and deregisters without generating, and that
lease's prompts go back to the front of the queue at once. It leaves
holding a lease on purpose: the controller names only idle replicas (no
lease) in weight-sync orders, so leaving right after a submit could let a
sync name it on its way out, and the others would wait for it until
``sync_timeout_s``. (A replica that takes updates in flight may be named while
it holds a lease too: its deregistration then fails that sync at once, and the
members already inside the broadcast wait out ``sync_timeout_s``.)
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import closing
from dataclasses import dataclass
from typing import Any

import torch

from phalanx.client import ControllerClient
from phalanx.comm.base import CommError
from phalanx.comm.torch_pg import serve_store
from phalanx.jobs.base import JobError, ReplicaArgs
from phalanx.jobs.common import emit, job_store_name, keep_freed_memory, register
from phalanx.log import ReplicaLogger
from phalanx.protocol.base import Scalar
from phalanx.protocol.rl import RolloutIn, SubmitReply, SyncOrder
from phalanx.rl.agentic.replica import episodes_of
from phalanx.rl.engine.base import EngineError, GenerationEngine, Owned
from phalanx.rl.engine.factory import rollout_engine, takes_inflight_updates
from phalanx.rl.generate import make_rollouts
from phalanx.rl.idle import IdleClock
from phalanx.rl.model import build_model
from phalanx.rl.tasks import task_from_config
from phalanx.rl.tokenizer import task_tokenizer
from phalanx.train.orders import Orders
from phalanx.transport.base import RolloutStore, WeightChannel
from phalanx.transport.factory import rollout_store, weight_channel

log = logging.getLogger("phalanx.jobs.rl_rollout")


def submit(
    client: ControllerClient, store: RolloutStore | None, lease_id: str, rollouts: list[RolloutIn]
) -> SubmitReply:
    """Submit a lease's rollouts: with their completions, or, with a rollout store
    outside the controller, put there first and submitted by ref. A payload the
    ledger did not accept (a duplicate, a stale one) is dropped from the store."""
    if store is None:
        return client.submit_rollouts(lease_id, rollouts)
    kept = [r for r in rollouts if not r.discard]  # a discarded one has no payload
    refs = iter(store.put([r.payload() for r in kept]))
    by_ref = [
        r if r.discard else r.model_copy(update={"completions": [], "ref": next(refs)})
        for r in rollouts
    ]
    return client.submit_rollouts(lease_id, by_ref)


def take_sync(
    client: ControllerClient,
    weights: WeightChannel,
    engine: GenerationEngine,
    order: SyncOrder,
    rlog: ReplicaLogger,
    inflight: bool = False,
) -> None:
    """Take part in a sync order: fetch the weights and load them into the engine, or,
    as the order's source (rank 0), relay the version the engine holds. Reported to
    the controller either way. ``inflight``: taken between two chunks of a generation.

    The ``sync`` event's ``sync_effect_s`` is the wall time from the policy's publish
    of the version (its commit: ``SyncOrder.published_at``) to the new weights being loaded,
    which is when the engine's next token is drawn from them (between leases, the
    generation of the lease that came with the order starts right after)."""
    t0 = time.perf_counter()
    source = order.rank == 0
    if source:
        res = weights.relay(order, engine.version)
        ok, err = res.ok, res.error
    else:
        try:
            fetch_into(engine, weights, order)
            ok, err = True, ""
        except (CommError, EngineError, ValueError) as e:
            # The engine holds its old version, or none (-1) after a reload that
            # failed part-way: either way it is ordered to sync again.
            ok, err = False, str(e)
    if not ok:
        rlog.warning("weight sync %d failed%s: %s", order.seq, " as source" * source, err[:200])
    ms = 1e3 * (time.perf_counter() - t0)
    since = order.published_at or order.ordered_at
    effect = time.time() - since if ok and not source and since else None
    client.sync_done(order.seq, engine.version, ok, err)
    emit(
        {
            "event": "sync",
            "role": "rollout",
            "replica": client.replica_id,
            "seq": order.seq,
            "version": engine.version,
            "ms": round(ms, 3),
            "ok": ok,
            "source": order.members[0],
            "inflight": inflight,
            "sync_effect_s": None if effect is None else round(max(effect, 0.0), 4),
            "t": time.time(),
        }
    )


def fetch_into(engine: GenerationEngine, weights: WeightChannel, order: SyncOrder) -> None:
    """Fetch the order's weights into ``engine``: as a stream, each tensor loaded while
    the next ones arrive, when the engine rolls back a stream cut off part-way
    (``streamed_updates``: vLLM); else whole first, then loaded. Either way a broken
    transfer leaves the engine on its version (CommError, EngineError)."""
    if not engine.streamed_updates:
        version, whole = weights.fetch(order, engine.layout())
        engine.load_weights(whole, version)
        return
    version, stream = weights.fetch_stream(order, engine.layout())
    with closing(stream):  # an engine that stopped early: the rest is still received
        # Owned: the channel receives each sync into a buffer of its own, which it
        # only reads afterwards (to relay): the engine may keep the tensors uncopied.
        engine.load_weights(Owned(stream), version)


@dataclass
class Syncs:
    """The sync orders this replica took: between leases (from a lease reply) and in
    flight (polled between chunks of a generation, as the engine's ``between`` hook)."""

    client: ControllerClient
    weights: WeightChannel
    engine: GenerationEngine
    rlog: ReplicaLogger
    delay_s: float = 0.0
    """``rl.loop.chunk_delay_s``: paces each chunk (a stand-in for a slower engine)."""
    seq: int = 0
    """The newest order taken (an order is taken once)."""
    inflight: int = 0
    """Orders taken during the current generation."""

    def take(self, order: SyncOrder | None, inflight: bool = False) -> None:
        if order is not None and order.seq > self.seq:
            self.seq = order.seq
            self.inflight += inflight
            take_sync(self.client, self.weights, self.engine, order, self.rlog, inflight)

    def poll(self) -> None:
        """Join the sync that names this replica now, if any (it holds a lease)."""
        self.take(self.client.sync_poll(self.engine.version), inflight=True)

    def between(self) -> None:
        """The engine's hook between two chunks of a generation."""
        if self.delay_s:
            time.sleep(self.delay_s)
        self.poll()

    def pause(self, seconds: float) -> None:
        """``rl.loop.gen_delay_s``: a stand-in for generation time, so a replica that
        takes updates in flight keeps polling through it (in 0.1 s slices): the
        controller counts on it to join a sync within one chunk's time."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.1))
            if self.engine.inflight_updates:
                self.poll()


def run(args: ReplicaArgs) -> int:
    """Generate rollouts for the job's RL ledger until the job finishes or the
    replica is drained."""
    cfg = args.cfg
    if cfg.rl is None:
        raise JobError("a rollout replica needs a job config with an [rl] section: got none.")
    rl, g = cfg.rl, cfg.rl.grpo
    keep_freed_memory()
    if g.threads:
        torch.set_num_threads(g.threads)
    device = torch.device(g.device)
    weights = weight_channel(rl.transport, cfg.job.id, rl.loop.sync_timeout_s, device)
    # A channel that relays serves the rendezvous of the syncs this replica is the
    # source of; the controller names only replicas that say so as a source.
    address, _rendezvous = "", None  # the store lives as long as this frame
    caps: dict[str, Scalar] = {}
    if weights.relays:
        _rendezvous, address = serve_store()
        caps["relays_weights"] = True
    if takes_inflight_updates(rl):  # the controller may then order syncs mid-generation
        caps["inflight_updates"] = True
    client = ControllerClient(
        str(args.controller), "rollout", args.name, address=address, capabilities=caps
    )
    register(client)
    client.start_heartbeat()
    rlog = ReplicaLogger(log, client.who)
    # Completions are keyed by prompt (make_rollouts), so which replica draws a
    # prompt, and how often it was dispatched, changes nothing.
    try:
        tok = task_tokenizer(rl.task)
        task = task_from_config(rl.task)
        engine = rollout_engine(rl, tok, build_model(rl.model, tok, device), device, args.name)
        episodes = episodes_of(rl, engine, tok)  # [rl.env]: multi-turn episodes
    except (EngineError, OSError, ValueError) as e:  # the job file's model, data or engine
        client.close("failed")
        raise JobError(str(e)) from e
    store = rollout_store(rl.transport, job_store_name(cfg.job.id, client))
    orders = Orders(client, kinds=("drain",))
    syncs = Syncs(client, weights, engine, rlog, rl.loop.chunk_delay_s)
    between = syncs.between if engine.inflight_updates else None
    released = 0
    drained = False
    idle = IdleClock()  # waiting for a lease or for weights, per generation batch
    emit(
        {
            "event": "start",
            "role": "rollout",
            "replica": client.replica_id,
            "pid": os.getpid(),
            "engine": rl.engine.kind,
        }
    )
    try:
        while True:
            idle.wait()
            r = client.lease_prompts(engine.version, rl.loop.prompts_per_lease, wait_s=5.0)
            syncs.take(r.sync)
            if r.finished:
                break  # after any sync in flight: the leader is waiting on this replica
            if engine.version < 0 and r.init_weights and syncs.seq == 0:
                # The model was built from config: the policy's step 0. (Not after a
                # sync that failed part-way: that engine waits for a good one.)
                engine.version = 0
            lease = r.lease
            orders.poll(0)
            if orders.drain:
                # Between two batches, after the sync (if any) this reply ordered: the
                # lease, if one came, goes back when this replica deregisters below.
                drained = True
                released = len(lease.prompts) if lease is not None else 0
                rlog.info("drained: leaving the job (%d leased prompts go back)", released)
                break
            if lease is None or engine.version < 0:
                continue
            idle.work()
            t0 = time.perf_counter()
            syncs.inflight = 0
            turns: dict[str, Any] = {}
            try:
                if episodes is None:
                    rollouts = make_rollouts(rl, engine, tok, task, lease.prompts, between)
                else:
                    rollouts, turns = episodes.lease(client, lease, between)
            except EngineError as e:
                # A weight update in flight failed part-way: the batch was abandoned
                # rather than finished on mixed weights. Its prompts go out again when
                # the lease expires; this replica waits for a sync that succeeds.
                rlog.warning("lease %s abandoned: %s", lease.lease_id, str(e)[:200])
                emit(
                    {
                        "event": "abandoned",
                        "role": "rollout",
                        "replica": client.replica_id,
                        "rollouts": [p.rollout_id for p in lease.prompts],
                        # [rl.env]: each episode's turn in flight (single-turn: the lease's
                        # completions) is dropped; the lease's prompts go out again.
                        "aborted_turns": len(lease.prompts) * g.group_size,
                        "reason": str(e)[:300],
                        "t": time.time(),
                    }
                )
                continue
            if rl.loop.gen_delay_s:
                syncs.pause(rl.loop.gen_delay_s * len(rollouts))
            gen_s = time.perf_counter() - t0
            res = submit(client, store, lease.lease_id, rollouts)
            n = len(rollouts)
            scored = [x for x in rollouts if not x.discard]
            emit(
                {
                    "event": "rollout",
                    "role": "rollout",
                    "replica": client.replica_id,
                    "version": engine.version,
                    # The behaviour versions of the lease's tokens (two or more when a
                    # sync landed during the generation: inflight_syncs).
                    "versions": sorted(
                        {v for x in rollouts for c in x.completions for v in c.versions}
                        | {x.version for x in rollouts}
                    ),
                    "inflight_syncs": syncs.inflight,
                    "prompts": n,
                    # Audit trail: the rollouts (prompt.attempt) of this lease.
                    "rollouts": [x.rollout_id for x in rollouts],
                    "accepted": len(res.accepted),
                    "duplicate": len(res.duplicate),
                    "stale": len(res.stale),
                    "unleased": len(res.unleased),
                    "discarded": len(res.discarded),
                    "reward": round(sum(x.reward for x in scored) / max(len(scored), 1), 4),
                    "exact_match": round(
                        sum(x.exact_match for x in scored) / max(len(scored), 1), 4
                    ),
                    "gen_s": round(gen_s, 4),
                    **turns,
                    "idle": idle.lap(),
                    "t": time.time(),
                }
            )
        done: dict[str, Any] = {"event": "done", "role": "rollout", "replica": client.replica_id}
        if drained:
            done.update(drained=True, released=released)
        emit(done)
    finally:
        engine.close()
        weights.close()
        if store is not None:
            store.close()
        client.close("drained" if drained else "finished")
    return 0

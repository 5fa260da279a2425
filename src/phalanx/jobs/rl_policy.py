"""A policy replica of an RL job: GRPO under the FT data-parallel manager.

Each step: quorum (rebuild the group and heal a joiner if membership
changed), lease the step's rollout batch from the controller (every member
of the quorum gets the same frozen batch), compute the clipped GRPO loss on
this replica's share of the rows, all-reduce, commit everywhere or nowhere,
then acknowledge the step so the controller marks the batch trained. A
batch is trained for ``grpo.inner_epochs`` consecutive steps, as in the
single-process baseline (:mod:`phalanx.jobs.rl_single`).

The batch's payloads (the completions) come with it from the controller's
rollout store, or, with a store outside the controller
(``rl.transport.rollouts``), are read from there by ref. A payload that is
missing, corrupt, or not what the ledger recorded is reported to the ledger
(which discards it with the reason and dispatches its prompt again), and
this replica abstains from the step: every replica retries it with the
batch frozen again without that rollout.

The quorum's rank 0 is the *policy leader*: when the controller orders a
weight sync (in a lease or ack reply), it publishes its committed weights,
version = its step count, through the :class:`WeightChannel` at the step
boundary, and training goes on while they are sent.

With ``state`` (a checkpoint root: a path or a storage URL, shared by the
job's policy replicas) the leader saves the committed state there with the
async DCP checkpointer, one save at a time. Each ack point is acknowledged as
committed at once (weights sync from it), and as durable once a save holding
it commits (:mod:`phalanx.rl.durable`): the ledger drops only durable batches,
so the newest checkpoint is never behind it. A restarted replica resumes from
it (any layout: the checkpoint reshards on load) or heals from a live peer. A
lone policy replica that is killed loses no acknowledged step.

An operator's ``drain`` (:mod:`phalanx.train.orders`) is honoured at an ack
point: the replica sends the ack of its last save, finishes any weight send
it leads, prints ``done`` with ``drained``, and deregisters; the other policy
replicas go on without it.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from typing import Any

import torch

from phalanx.client import ControllerClient, QuorumTimeout
from phalanx.comm.torch_pg import TorchCommunicator, serve_store
from phalanx.config.rl import RLConfig
from phalanx.jobs.base import JobError, ReplicaArgs
from phalanx.jobs.common import emit, job_store_name, keep_freed_memory, resume
from phalanx.log import ReplicaLogger
from phalanx.protocol.rl import Batch, BatchAckReply, SyncOrder
from phalanx.rl.durable import DurableAcks, policy_checkpointer
from phalanx.rl.grpo import lr_lambda
from phalanx.rl.model import build_model, num_params
from phalanx.rl.step import peak_memory_mb, prepare
from phalanx.rl.tokenizer import task_tokenizer
from phalanx.rl.trainer import PolicyTrainer, Rows, check_payload
from phalanx.train.manager import Manager
from phalanx.train.orders import Orders
from phalanx.train.snapshot import save_state
from phalanx.transport.base import RolloutStore, SyncResult, WeightChannel
from phalanx.transport.factory import rollout_store, weight_channel

log = logging.getLogger("phalanx.jobs.rl_policy")


def payloads_of(
    batch: Batch, store: RolloutStore | None, rl: RLConfig
) -> tuple[Rows, list[tuple[str, str]]]:
    """The batch's (prompt, payload) rows, and the rollouts whose payloads could not
    be read or do not fit (``(rollout id, reason)``)."""
    g = rl.grpo
    found: dict[str, Any] = {}
    lost: list[tuple[str, str]] = []
    refs = [r.ref for r in batch.rollouts if r.ref is not None]
    if refs:
        if store is None:
            raise JobError(
                "the ledger gave rollouts by ref but this replica has no rollout store: "
                "rl.transport.rollouts must be the same for the controller and every replica."
            )
        found, missing = store.get(refs)
        by_ref = {r.ref: r.rollout_id for r in batch.rollouts}
        lost += [(by_ref[ref], why) for ref, why in missing.items()]
    rows: Rows = []
    for r in batch.rollouts:
        if r.ref is not None:
            p = found.get(r.ref)
            if p is None:
                continue  # counted as lost above
        elif r.completions:
            p = r.payload()
        else:
            lost.append((r.rollout_id, "payload_missing"))
            continue
        why = check_payload(p, r, g.group_size, g.max_new_tokens)
        if why is not None:
            log.warning("rollout %s: its payload %s; reported lost", r.rollout_id, why)
            lost.append((r.rollout_id, "payload_corrupt"))
            continue
        rows.append((r.prompt, p))
    return rows, lost


class Leader:
    """Publishes the committed weights when a sync order names this replica as its
    source (the quorum's rank 0, the policy leader), at the step boundary; the
    channel sends them in the background and the outcome goes to the controller."""

    def __init__(self, client: ControllerClient, weights: WeightChannel):
        self.client, self.weights = client, weights
        self.published = 0
        self.rlog = ReplicaLogger(log, client.who)

    def report(self, res: SyncResult) -> None:
        emit(
            {
                "event": "sync",
                "role": "policy",
                "replica": self.client.replica_id,
                "seq": res.seq,
                "version": res.version,
                "ms": round(1e3 * res.seconds, 3),
                "bytes": res.nbytes,
                "members": res.members,
                "ok": res.ok,
                "error": res.error[:200],
            }
        )
        try:
            self.client.sync_done(res.seq, res.version, res.ok, res.error)
        except Exception as e:  # the controller times the sync out if this is lost
            self.rlog.warning("sync report not delivered: %s", e)

    def serve(self, order: SyncOrder | None, step: int, model: torch.nn.Module) -> None:
        if order is None or order.seq <= self.published or order.rank != 0:
            return
        self.published = order.seq
        self.weights.publish(step, model.state_dict(), order, self.report)


def run(args: ReplicaArgs) -> int:
    """Train the job's policy with GRPO as one replica, until the ledger says the job
    is finished or the replica is drained."""
    cfg, state, out = args.cfg, args.state, args.out
    if cfg.rl is None:
        raise JobError("a policy replica needs a job config with an [rl] section: got none.")
    rl, g = cfg.rl, cfg.rl.grpo
    keep_freed_memory()
    if g.threads:
        torch.set_num_threads(g.threads)
    torch.manual_seed(cfg.job.seed)
    store, address = serve_store()
    client = ControllerClient(str(args.controller), "policy", args.name, address=address)
    client.register()
    status = client.status()
    if status.rl is not None and status.rl.finished:
        emit({"event": "done", "role": "policy", "replica": client.replica_id, "step": 0})
        client.close("job already finished")
        return 0
    client.start_heartbeat()
    rlog = ReplicaLogger(log, client.who)
    device = torch.device(g.device)
    try:
        tok = task_tokenizer(rl.task)
        model = prepare(build_model(rl.model, tok, device).train(), g)
    except (OSError, ValueError) as e:  # the job file's model or tokenizer
        client.close("failed")
        raise JobError(str(e)) from e
    ref = build_model(rl.model, tok, device).eval().requires_grad_(False) if g.kl_coef else None
    opt = torch.optim.AdamW(model.parameters(), lr=g.lr, betas=g.betas, weight_decay=g.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(g, g.steps * g.inner_epochs))
    comm = TorchCommunicator(cfg.timeouts.collective_s, device)
    manager = Manager(
        client,
        comm,
        model,
        opt,
        None,
        global_batch_size=g.prompts_per_step * g.group_size,
        quorum_timeout_s=cfg.timeouts.quorum_s,
    )
    manager.register_state("scheduler", sched.state_dict, sched.load_state_dict)
    ckpt = policy_checkpointer(state)
    acks = DurableAcks(client, ckpt, {"job_id": cfg.job.id, "kind": "rl-policy"})
    if ckpt is not None:
        resumed = resume(ckpt, manager)  # NoUsableCheckpoint: the launcher stops the job
        if resumed is not None:
            acks.durable = resumed
            rlog.info("resumed from %s at step %d", state, resumed)
    trainer = PolicyTrainer(rl, manager, model, tok.pad_id, ref)
    weights = weight_channel(rl.transport, cfg.job.id, rl.loop.sync_timeout_s, device)
    payloads = rollout_store(rl.transport, job_store_name(cfg.job.id, client))
    leader = Leader(client, weights)
    metrics: OrderedDict[int, tuple[float, float]] = OrderedDict()
    emit(
        {
            "event": "start",
            "role": "policy",
            "replica": client.replica_id,
            "pid": os.getpid(),
            "params": num_params(model),
        }
    )
    orders = Orders(client, kinds=("drain",))
    finished = drained = False

    def acked_by(replies: list[BatchAckReply]) -> bool:
        for a in replies:
            leader.serve(a.sync, manager.step, model)
        return any(a.finished for a in replies)

    batch: Batch | None = None
    rows: Rows = []
    try:
        while not finished and not drained:
            try:
                manager.start_quorum()
                q = manager.wait_quorum()
            except QuorumTimeout as e:
                rlog.warning("%s; asking again", e)
                continue
            healed = client.replica_id in q.heal
            finished = acked_by(acks.poll()) or finished
            manager.grads.zero()
            t0 = time.perf_counter()
            if batch is None or batch.index != manager.step // g.inner_epochs:
                # A batch spans inner_epochs steps: ask only when this step starts a new one.
                batch = None
                while batch is None and not finished:
                    # A save in flight: ask briefly, so that its ack goes soon after it commits.
                    wait_s = 0.2 if acks.pending else 5.0
                    r = client.lease_batch(manager.step, wait_s, acks.durable_for_lease)
                    leader.serve(r.sync, manager.step, model)
                    batch, finished = r.batch, r.finished or acked_by(acks.poll())
                if batch is None:
                    break
                rows, lost = payloads_of(batch, payloads, rl)
                if lost:
                    client.lost_payloads(lost)
                    manager.abstain(f"{len(lost)} payload(s) of batch {batch.index} lost")
            t1 = time.perf_counter()
            stats = trainer.compute(rows) if manager.error is None else {"loss": 0.0}
            total = manager.allreduce_grads(stats["loss"])
            t2 = time.perf_counter()
            if not manager.should_commit():
                batch = None  # ask again: the ledger may have frozen it anew (lost payloads)
                emit(
                    {
                        "event": "retry",
                        "role": "policy",
                        "replica": client.replica_id,
                        "step": manager.step,
                        "error": (manager.error or "")[:200],
                    }
                )
                continue
            if g.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), g.grad_clip)
            opt.step()
            sched.step()
            acked = manager.step % g.inner_epochs == 0 or manager.step % rl.loop.sync_every == 0
            if acked:
                # Committed now; durable once a checkpoint holds the step (DurableAcks):
                # a restart retrains at most undurable steps, whose batches stay frozen.
                replies = acks.ack(manager, trainer.metrics(rows, stats, t2 - t1))
                finished = acked_by(replies) or finished
            t3 = time.perf_counter()
            metrics[batch.index] = (batch.reward, batch.exact_match)
            while len(metrics) > rl.loop.window:
                metrics.popitem(last=False)
            client.report_progress(loss=total)
            emit(
                {
                    "event": "step",
                    "role": "policy",
                    "replica": client.replica_id,
                    "step": manager.step,
                    "batch": batch.index,
                    "reward": round(batch.reward, 4),
                    "exact_match": round(batch.exact_match, 4),
                    "reward_avg": round(sum(v[0] for v in metrics.values()) / len(metrics), 4),
                    "exact_match_avg": round(sum(v[1] for v in metrics.values()) / len(metrics), 4),
                    "staleness": batch.staleness,
                    "loss": round(total, 6),
                    "entropy": round(stats.get("entropy", 0.0), 4),
                    "kl_behaviour": round(stats.get("kl_behaviour", 0.0), 6),
                    "clip_frac": round(stats.get("clip_frac", 0.0), 4),
                    # This replica's share: the tokens it read, over its compute time.
                    "train_tokens": int(stats.get("train_tokens", 0)),
                    "train_tokens_per_s": round(
                        stats.get("train_tokens", 0) / max(t2 - t1, 1e-9), 1
                    ),
                    "peak_mem_mb": round(peak_memory_mb(device), 1),
                    "participants": manager.world_size,
                    "quorum_id": q.quorum_id,
                    "healed": healed,
                    "version": manager.step,
                    # Audit trail: which rollouts (prompt.attempt) this batch trained on.
                    "rollouts": [r.rollout_id for r in batch.rollouts]
                    if manager.step % g.inner_epochs == 0
                    else [],
                    "versions": sorted({r.version for r in batch.rollouts}),
                    "lease_s": round(t1 - t0, 4),
                    "compute_s": round(t2 - t1, 4),
                    "commit_s": round(t3 - t2, 4),
                    "t": time.time(),
                }
            )
            if acked and not finished:
                # Leave only at an ack point: the leader's last save is acknowledged on
                # the way out, the others' state is the leader's, so nothing is trained twice.
                orders.poll(manager.step)
                drained = orders.drain
        finished = acked_by(acks.close()) or finished
        if weights.pending is not None:
            # A drained leader too: the rollout replicas of its last sync wait for it.
            weights.pending.result(timeout=rl.loop.sync_timeout_s * 2)
        if drained:
            rlog.info("drained at step %d: leaving the job", manager.step)
        elif out is not None:
            save_state(out, {"model": model.state_dict(), "step": manager.step})
        emit(
            {
                "event": "done",
                "role": "policy",
                "replica": client.replica_id,
                "step": manager.step,
                "heals": manager.heals,
                **({"drained": True} if drained else {}),
            }
        )
    finally:
        if payloads is not None:
            payloads.close()
        weights.close()
        manager.close()
        client.close("drained" if drained else "finished")
        del store
    return 0

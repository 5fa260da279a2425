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

A policy replica may span several ranks (``[replica] ranks = N``): the model
is sharded over them with FSDP2, or tensor-parallel over groups of ``tp`` of
them and FSDP2 over the rest (``[replica] tp``, :mod:`phalanx.train.tp_hf`; the
reference model alike), and the FT manager all-reduces each shard across
replicas (:mod:`phalanx.train.hsdp`). Only its rank 0 talks to the
controller; what the others must do alike (the step's rows, a save of their
shards, their part in gathering the weights a sync sends, leaving) reaches
them through :mod:`phalanx.jobs.policy_ranks`. A failing rank fails the whole
replica, which resumes from the sharded checkpoint or heals shard by shard.

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
import torch.distributed as dist

from phalanx.client import ControllerClient, QuorumTimeout
from phalanx.comm.torch_pg import TorchCommunicator
from phalanx.config.rl import RLConfig
from phalanx.jobs import policy_end
from phalanx.jobs.base import JobError, ReplicaArgs
from phalanx.jobs.common import emit, job_store_name, keep_freed_memory, resume, use_root
from phalanx.jobs.policy_ranks import Coordinator, Publisher, full_optimizer_state, full_weights
from phalanx.jobs.replica_ranks import register_ranks, replica_ranks, replica_stopped, wrap
from phalanx.log import ReplicaLogger
from phalanx.protocol.rl import Batch
from phalanx.rl.durable import DurableAcks, policy_checkpointer
from phalanx.rl.grpo import lr_lambda
from phalanx.rl.idle import IdleClock
from phalanx.rl.lora import policy_model
from phalanx.rl.model import build_model, num_params
from phalanx.rl.step import peak_memory_mb
from phalanx.rl.tokenizer import task_tokenizer
from phalanx.rl.trainer import PolicyTrainer, Rows, check_payload, staleness_of
from phalanx.train.base import JobFinished
from phalanx.train.hsdp import HSDPManager, ReplicaBroken, ReplicaRanks
from phalanx.train.manager import Manager
from phalanx.train.orders import Orders
from phalanx.train.shards import clip_grad_norm
from phalanx.train.snapshot import save_state
from phalanx.transport.base import RolloutStore
from phalanx.transport.factory import rollout_store, weight_channel
from phalanx.transport.replay import ReplayReader, replay_reader, replayed_payloads

log = logging.getLogger("phalanx.jobs.rl_policy")


def payloads_of(
    batch: Batch, store: RolloutStore | None, rl: RLConfig, replay: ReplayReader | None = None
) -> tuple[Rows, list[tuple[str, str]]]:
    """The batch's (prompt, payload) rows, and the rollouts whose payloads could not
    be read or do not fit (``(rollout id, reason)``). Replayed rollouts that come
    without their payload are read by id from the Redis ``replay``; their stored
    behaviour log-probs are what the loss's importance weights use."""
    g = rl.grpo
    found: dict[str, Any] = {}
    lost: list[tuple[str, str]] = []
    replayed = replayed_payloads(batch, replay)
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
        elif r.rollout_id in replayed:
            p = replayed[r.rollout_id]
        else:
            lost.append((r.rollout_id, "payload_missing"))
            continue
        why = check_payload(p, r, g.group_size, rl.completion_limit())
        if why is not None:
            log.warning("rollout %s: its payload %s; reported lost", r.rollout_id, why)
            lost.append((r.rollout_id, "payload_corrupt"))
            continue
        rows.append((r.prompt, p))
    return rows, lost


def _finished(client: ControllerClient) -> dict[str, Any]:
    status = client.status()
    return {"finished": status.rl is not None and status.rl.finished}


def run(args: ReplicaArgs) -> int:
    """Train the job's policy with GRPO as one replica (one rank of it, when it spans
    several), until the ledger says the job is finished or the replica is drained."""
    cfg = args.cfg
    if cfg.rl is None:
        raise JobError("a policy replica needs a job config with an [rl] section: got none.")
    g = cfg.rl.grpo
    keep_freed_memory()
    if g.threads:
        torch.set_num_threads(g.threads)
    torch.manual_seed(cfg.job.seed)
    device = torch.device(g.device)
    if device.type == "cuda" and cfg.replica.ranks > 1:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    ranks = replica_ranks(cfg, device)
    try:
        return _run(args, ranks, device)
    except (ReplicaBroken, dist.DistError) as e:
        return replica_stopped(ranks.rank, e)
    except RuntimeError as e:  # gloo's collectives raise plain RuntimeErrors
        if ranks.size == 1:
            raise
        return replica_stopped(ranks.rank, e)
    finally:
        ranks.close()


def _run(args: ReplicaArgs, ranks: Any, device: torch.device) -> int:
    cfg, state, out = args.cfg, args.state, args.out
    assert cfg.rl is not None
    rl, g = cfg.rl, cfg.rl.grpo
    lead = ranks.leader
    client, store, facts = register_ranks(
        str(args.controller),
        "policy",
        args.name,
        ranks,
        _finished,
        lambda c: use_root(c, str(state) if state is not None else None, what="--state"),
    )
    finished = bool(facts["finished"])
    if finished:
        if lead:
            policy_end.joined_finished(client)
        return 0
    if lead:
        client.start_heartbeat()
    rlog = ReplicaLogger(log, client.who)
    try:
        tok = task_tokenizer(rl.task)
        model = policy_model(rl, tok, device)  # with [rl.lora]: a peft model, base frozen
        ref = build_model(rl.model, tok, device).eval().requires_grad_(False) if g.kl_coef else None
    except (OSError, ValueError) as e:  # the job file's model or tokenizer
        if lead:
            client.close("failed")
        raise JobError(str(e)) from e
    params = num_params(model)
    if isinstance(ranks, ReplicaRanks):  # FSDP2, or TP then FSDP2 ([replica] tp)
        model = wrap(model, ranks)
        ref = wrap(ref, ranks) if ref is not None else None
    trained = [p for p in model.parameters() if p.requires_grad]  # LoRA: the adapter's
    opt = torch.optim.AdamW(trained, lr=g.lr, betas=g.betas, weight_decay=g.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(g, g.steps * g.inner_epochs))
    # Liveness patience for single-process replicas: a sharded replica's cross-replica
    # groups are per rank, and a rank's store (and pings) are its replica's rank 0's.
    patience = 0.0 if isinstance(ranks, ReplicaRanks) else cfg.timeouts.collective_patience_s
    comm = TorchCommunicator(cfg.timeouts.collective_s, device, patience)
    batch_size, quorum_s = g.prompts_per_step * g.group_size, cfg.timeouts.quorum_s
    kw: dict[str, Any] = {"global_batch_size": batch_size, "quorum_timeout_s": quorum_s}
    kw["exact_reduction"], kw["trainable_only"] = g.exact_reduction, rl.lora is not None
    if isinstance(ranks, ReplicaRanks):
        manager: Manager = HSDPManager(client, ranks, comm, model, opt, None, **kw)
    else:
        manager = Manager(client, comm, model, opt, None, **kw)
    manager.register_state("scheduler", sched.state_dict, sched.load_state_dict)
    extra = {"job_id": cfg.job.id, "kind": "rl-policy"}
    ckpt = policy_checkpointer(state)  # a collective over the replica's ranks
    acks = DurableAcks(client, ckpt, extra)
    if ckpt is not None:
        if ranks.size > 1:
            ckpt.layout = {"kind": "rl-policy", "ranks": ranks.size, "tp": cfg.replica.tp}
        resumed = resume(ckpt, manager)  # NoUsableCheckpoint: the launcher stops the job
        if resumed is not None:
            acks.durable = resumed
            rlog.info("resumed from %s at step %d", state, resumed)
    parts = cfg.roles["policy"].n_init_replicas * cfg.replica.dp  # (a TP group: one part)
    trainer = PolicyTrainer(rl, manager, model, tok.pad_id, ref, exact_parts=parts)
    weights = (
        weight_channel(rl.transport, cfg.job.id, rl.loop.sync_timeout_s, device) if lead else None
    )
    name = job_store_name(cfg.job.id, client) if lead else ""  # the leader reads payloads
    payloads = rollout_store(rl.transport, name) if lead else None
    replay = replay_reader(rl.transport, name) if lead else None
    coord = Coordinator(ranks, manager, acks, Publisher(client, weights, lead), ckpt, extra)
    metrics: OrderedDict[int, tuple[float, float]] = OrderedDict()
    idle = IdleClock()  # waiting for rollouts (the batch lease), per step and per ack
    if lead:
        emit(
            {
                "event": "start",
                "role": "policy",
                "replica": client.replica_id,
                "pid": os.getpid(),
                "params": params,
                "ranks": ranks.size,
            }
        )
    orders = Orders(client, kinds=("drain",)) if lead else None
    drained = at_end = behind = False
    batch: Batch | None = None  # (the leader's: the ledger's summary of the rows)
    index: int | None = None
    rows: Rows = []
    try:
        while not finished and not drained and not at_end:
            try:
                manager.start_quorum()
                q = manager.wait_quorum()
            except QuorumTimeout as e:
                rlog.warning("%s; asking again", e)
                continue
            except JobFinished as e:  # behind a finished job, with no peer to heal from
                rlog.info("%s; nothing left to do", e)
                acks.stop_saving()
                finished = behind = True
                break
            healed = client.replica_id in q.heal
            if healed:
                trainer.proximal.forget()  # recorded under weights the heal replaced
            top = coord.agree(coord.plan(acks.poll()) if lead else None)
            finished, at_end = top.finished or finished, top.at_end or at_end
            if at_end:
                break
            manager.grads.zero()
            t0 = time.perf_counter()
            idle.wait()
            if index is None or index != manager.step // g.inner_epochs:
                # A batch spans inner_epochs steps: ask only when this step starts a new one.
                index = None
                while index is None and not finished:
                    plan = None
                    if lead:
                        # A save in flight: ask briefly, so that its ack goes soon after it commits.
                        wait_s = 0.2 if acks.pending else 5.0
                        r = client.lease_batch(manager.step, wait_s, acks.durable_for_lease)
                        plan = coord.plan([r, *acks.poll()])
                        batch = r.batch
                        if batch is not None:
                            plan.batch, (plan.rows, lost) = (
                                batch.index,
                                payloads_of(batch, payloads, rl, replay),
                            )
                            if lost:
                                client.lost_payloads(lost)
                                plan.abstain = f"{len(lost)} payload(s) of batch {batch.index} lost"
                    plan = coord.agree(plan)
                    finished, at_end = plan.finished or finished, plan.at_end or at_end
                    if at_end:
                        break  # the job's last step: no batch past it
                    index, rows = plan.batch, plan.rows
                    if plan.abstain is not None:
                        manager.abstain(plan.abstain)
                if index is None:
                    break
            t1 = time.perf_counter()
            idle.work()
            trained_from = manager.step  # the weights version this step's forward sees
            stats = trainer.compute(rows) if manager.error is None else {"loss": 0.0}
            total = manager.allreduce_grads(stats["loss"])
            t2 = time.perf_counter()
            if not manager.should_commit():
                index = None  # ask again: the ledger may have frozen it anew (lost payloads)
                if lead:
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
                clip_grad_norm(trained, g.grad_clip)  # (TP: gradients on several meshes)
            opt.step()
            sched.step()
            step_idle = idle.lap("step")
            # The replica's tokens: every TP group read its part of the share (PolicyTrainer).
            stats["train_tokens"] = ranks.sum([stats.get("train_tokens", 0.0)])[0]
            acked = manager.step % g.inner_epochs == 0 or manager.step % rl.loop.sync_every == 0
            plan = None
            if acked and lead:
                # Committed now; durable once a checkpoint holds the step (DurableAcks):
                # a restart retrains at most undurable steps, whose batches stay frozen.
                assert orders is not None
                m = trainer.metrics(rows, stats, t2 - t1, trained_from)
                m = m.model_copy(update={"idle": idle.lap("ack")})
                plan = coord.plan(acks.ack(manager, m))
                if not plan.finished:
                    # Leave only at an ack point: the leader's last save is acknowledged
                    # on the way out, the others' state is the leader's, so nothing is
                    # trained twice.
                    orders.poll(manager.step)
                    plan.drain = orders.drain
            t3 = time.perf_counter()
            if lead:
                assert batch is not None
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
                        "exact_match_avg": round(
                            sum(v[1] for v in metrics.values()) / len(metrics), 4
                        ),
                        "staleness": batch.staleness,
                        "loss": round(total, 6),
                        "entropy": round(stats.get("entropy", 0.0), 4),
                        "kl_behaviour": round(stats.get("kl_behaviour", 0.0), 6),
                        "clip_frac": round(stats.get("clip_frac", 0.0), 4),
                        "mismatch_kl": round(stats.get("mismatch_kl", 0.0), 6),
                        "ess": round(stats.get("ess", 1.0), 4),
                        "is_clip_frac": round(stats.get("is_clip_frac", 0.0), 4),
                        "is_mask_frac": round(stats.get("is_mask_frac", 0.0), 4),
                        "staleness_tokens": staleness_of(rows, trained_from),
                        "idle": step_idle,  # waiting for rollouts, over the step's wall time
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
                        "rollouts": [r.rollout_id for r in batch.rollouts if not r.replayed]
                        if manager.step % g.inner_epochs == 0
                        else [],
                        "replayed": [r.rollout_id for r in batch.rollouts if r.replayed]
                        if manager.step % g.inner_epochs == 0
                        else [],
                        "versions": sorted({r.version for r in batch.rollouts}),
                        "lease_s": round(t1 - t0, 4),
                        "compute_s": round(t2 - t1, 4),
                        "commit_s": round(t3 - t2, 4),
                        "t": time.time(),
                    }
                )
            if acked:
                # After the step line: a rank lost in this agreement stops the replica,
                # and the line of a step the leader acknowledged must not be lost with it
                # (the audit trail of the rollouts it trained).
                plan = coord.agree(plan)
                finished, drained = plan.finished or finished, plan.drain
                at_end = plan.at_end or at_end
        if at_end and not finished and not drained:
            finished = True
            behind = not policy_end.finish(coord, manager, acks, client)
        finished = coord.close() or finished
        if weights is not None and weights.pending is not None:
            # A drained leader too: the rollout replicas of its last sync wait for it.
            weights.pending.result(timeout=rl.loop.sync_timeout_s * 2)
        if drained:
            rlog.info("drained at step %d: leaving the job", manager.step)
        elif behind:
            rlog.info("the job finished at a later step than this replica's: no final file")
        elif out is not None:
            whole = full_weights(model, keep=lead)  # (collectives when sharded)
            optim = full_optimizer_state(opt, keep=lead)
            if whole is not None:
                save_state(out, {"model": dict(whole), "optimizer": optim, "step": manager.step})
        if lead:
            emit(
                {
                    "event": "done",
                    "role": "policy",
                    "replica": client.replica_id,
                    "step": manager.step,
                    "heals": manager.heals,
                    **({"drained": True} if drained else {}),
                    **({"finished_elsewhere": True} if behind else {}),
                }
            )
    finally:
        if payloads is not None:
            payloads.close()
        if weights is not None:
            weights.close()
        if ckpt is not None:
            try:
                ckpt.close()
            except Exception as e:  # its ack was never sent: that step stays undurable
                rlog.warning("the last checkpoint failed: %s", e)
        manager.close()
        if lead:
            client.close("drained" if drained else "finished")
        del store
    return 0

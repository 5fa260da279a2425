"""A policy replica of an RL job: GRPO under the FT data-parallel manager.

Each step: quorum (rebuild the group and heal a joiner if membership
changed), lease the step's rollout batch from the controller (every member
of the quorum gets the same frozen batch), compute the clipped GRPO loss on
this replica's share of the rows, all-reduce, commit everywhere or nowhere,
then acknowledge the step so the controller marks the batch trained. A
batch is trained for ``grpo.inner_epochs`` consecutive steps, as in the
single-process baseline (:mod:`phalanx.rl.single`).

With a rollout queue configured (``rl.transport.rollouts``), every policy
replica also drains the queue into the controller's ledger from a thread
(:class:`~phalanx.transport.ingest.Ingest`): the batches still come from the
ledger, which deduplicates and batches as with direct submissions.

The quorum's rank 0 is the *policy leader*: when the controller orders a
weight sync (in a lease or ack reply), it publishes its committed weights,
version = its step count, through the :class:`WeightChannel` at the step
boundary, and training goes on while they are sent.

With ``state`` set, the replica writes its committed state to that file
before every ack (so the file is never behind the controller), and resumes
from it when restarted: a lone policy replica that is killed loses nothing.

An operator's ``drain`` (:mod:`phalanx.train.orders`) is honoured after a
committed step that was acknowledged (its batch trained, the state file
written): the replica finishes any weight send it leads, prints ``done``
with ``drained``, and deregisters; the other policy replicas go on without it.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch

from phalanx.client import ControllerClient, QuorumTimeout
from phalanx.comm.torch_pg import TorchCommunicator, serve_store
from phalanx.config import JobConfig
from phalanx.controller.ledger import rollout_prompt
from phalanx.log import ReplicaLogger
from phalanx.rl.config import RLConfig
from phalanx.rl.engine.base import Completion
from phalanx.rl.grpo import collate, group_advantages, grpo_loss, reference_logprobs
from phalanx.rl.model import build_model, num_params
from phalanx.rl.single import _rows_to_train, lr_lambda
from phalanx.rl.tokenizer import load_tokenizer
from phalanx.train.batch import split
from phalanx.train.job import emit, keep_freed_memory
from phalanx.train.manager import Manager
from phalanx.train.orders import Orders
from phalanx.train.snapshot import load_state, save_state
from phalanx.transport.base import SyncOrder, SyncResult
from phalanx.transport.factory import queue_name, rollout_queue, weight_channel
from phalanx.transport.ingest import Ingest

log = logging.getLogger("phalanx.rl.policy")


def completions_of(batch: dict[str, Any]) -> tuple[list[Completion], list[float]]:
    """The batch's completions, prompt-major in prompt order, and their rewards.

    The ledger lists a batch's rollouts in arrival order, which depends on
    timing; prompt order makes the loss's sums (and so the trained weights) the
    same whichever replica submitted first or how often a prompt was dispatched."""
    comps, rewards = [], []
    for r in sorted(batch["rollouts"], key=lambda r: rollout_prompt(r["rollout_id"])[0]):
        for c in r["completions"]:
            comps.append(
                Completion(
                    0, c["prompt_ids"], c["token_ids"], c["logprobs"], c["finished"], r["version"]
                )
            )
            rewards.append(float(c["reward"]))
    return comps, rewards


class PolicyTrainer:
    """The GRPO step of one policy replica over the manager's quorum."""

    def __init__(self, rl: RLConfig, manager: Manager, model: Any, pad_id: int, ref: Any = None):
        self.rl, self.g = rl, rl.grpo
        self.manager, self.model, self.pad_id, self.ref = manager, model, pad_id, ref
        self.device = torch.device(self.g.device)

    def compute(self, batch: dict[str, Any]) -> float:
        """Forward and backward on this replica's share of the batch's trainable rows.
        Returns this share's loss (already normalised by the batch's token count)."""
        g, m = self.g, self.manager
        comps, rewards = completions_of(batch)
        adv = group_advantages(torch.tensor(rewards), g.group_size, g.adv_eps)
        keep = _rows_to_train(adv, g.kl_coef)
        off, count = split(len(keep), m.world_size, m.rank)
        mine = keep[off : off + count]
        if not mine:
            return 0.0
        n_tokens = sum(len(c.token_ids) for c in comps)
        rows = collate([comps[i] for i in mine], adv[mine], self.pad_id, self.device)
        ref_lp = reference_logprobs(self.ref, rows, g.temperature) if self.ref is not None else None
        loss, _ = grpo_loss(
            self.model,
            rows,
            clip_eps=g.clip_eps,
            clip_eps_high=g.clip_eps_high,
            temperature=g.temperature,
            num_tokens=n_tokens,
            kl_coef=g.kl_coef,
            ref_logprobs=ref_lp,
        )
        loss.backward()
        return float(loss.item())


def run_policy(
    cfg: JobConfig,
    controller: str,
    name: str,
    out: Path | None = None,
    state: Path | None = None,
) -> int:
    assert cfg.rl is not None, "run_policy needs a job config with an [rl] section"
    rl, g = cfg.rl, cfg.rl.grpo
    keep_freed_memory()
    if g.threads:
        torch.set_num_threads(g.threads)
    torch.manual_seed(cfg.job.seed)
    store, address = serve_store()
    client = ControllerClient(controller, "policy", name, address=address)
    client.register()
    if client.status()["rl"]["finished"]:
        emit({"event": "done", "role": "policy", "replica": client.replica_id, "step": 0})
        client.close("job already finished")
        return 0
    client.start_heartbeat()
    rlog = ReplicaLogger(log, client.who)
    device = torch.device(g.device)
    tok = load_tokenizer(rl.task.tokenizer_path)
    model = build_model(rl.model, tok, device).train()
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
    if state is not None and state.exists():
        try:
            manager.load_state_dict(load_state(state))
            rlog.info("resumed from %s at step %d", state, manager.step)
        except ValueError as e:
            rlog.error("%s; starting from scratch", e)
    trainer = PolicyTrainer(rl, manager, model, tok.pad_id, ref)
    weights = weight_channel(rl.transport, cfg.job.id, rl.loop.sync_timeout_s, device)
    queue = rollout_queue(rl.transport, queue_name(cfg.job.id, client), str(client.replica_id))
    ingest = Ingest(queue, client, rl.transport.ingest_batch).start() if queue else None
    published = 0
    metrics: OrderedDict[int, tuple[float, float]] = OrderedDict()

    def report(res: SyncResult) -> None:
        emit(
            {
                "event": "sync",
                "role": "policy",
                "replica": client.replica_id,
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
            client.sync_done(res.seq, res.version, res.ok, res.error)
        except Exception as e:  # the controller times the sync out if this is lost
            rlog.warning("sync report not delivered: %s", e)

    def serve(reply: dict[str, Any]) -> None:
        """Publish the committed weights if a sync order names this replica as its source."""
        nonlocal published
        order = reply.get("sync")
        if order is None or order["seq"] <= published or order["rank"] != 0:
            return
        published = order["seq"]
        weights.publish(manager.step, model.state_dict(), SyncOrder.from_reply(order), report)

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
    batch: dict[str, Any] | None = None
    try:
        while not finished and not drained:
            try:
                manager.start_quorum()
                q = manager.wait_quorum()
            except QuorumTimeout as e:
                rlog.warning("%s; asking again", e)
                continue
            healed = client.replica_id in q.heal
            manager.grads.zero()
            t0 = time.perf_counter()
            if batch is None or batch["index"] != manager.step // g.inner_epochs:
                # A batch spans inner_epochs steps: ask only when this step starts a new one.
                batch = None
                while batch is None and not finished:
                    r = client.lease_batch(manager.step, wait_s=5.0)
                    serve(r)
                    batch, finished = r["batch"], r["finished"]
                if batch is None:
                    break
            t1 = time.perf_counter()
            loss = trainer.compute(batch) if manager._ok else 0.0
            total = manager.allreduce_grads(loss)
            t2 = time.perf_counter()
            if not manager.should_commit():
                emit(
                    {
                        "event": "retry",
                        "role": "policy",
                        "replica": client.replica_id,
                        "step": manager.step,
                        "error": (manager._error or "")[:200],
                    }
                )
                continue
            if g.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), g.grad_clip)
            opt.step()
            sched.step()
            acked = manager.step % g.inner_epochs == 0 or manager.step % rl.loop.sync_every == 0
            if acked:
                # Saved before the ack, so the file is never behind the controller: a
                # restart from it retrains at most the unacknowledged steps, whose
                # batch is still frozen for them.
                if state is not None:
                    save_state(state, manager.state_dict())
                ack = client.ack_batch(manager.step)
                serve(ack)
                finished = ack["finished"]
            t3 = time.perf_counter()
            metrics[batch["index"]] = (batch["reward"], batch["exact_match"])
            while len(metrics) > rl.loop.window:
                metrics.popitem(last=False)
            client.loss = total
            emit(
                {
                    "event": "step",
                    "role": "policy",
                    "replica": client.replica_id,
                    "step": manager.step,
                    "batch": batch["index"],
                    "reward": round(batch["reward"], 4),
                    "exact_match": round(batch["exact_match"], 4),
                    "reward_avg": round(sum(v[0] for v in metrics.values()) / len(metrics), 4),
                    "exact_match_avg": round(sum(v[1] for v in metrics.values()) / len(metrics), 4),
                    "staleness": batch["staleness"],
                    "loss": round(total, 6),
                    "participants": manager.world_size,
                    "quorum_id": q.quorum_id,
                    "healed": healed,
                    "version": manager.step,
                    # Audit trail: which rollouts (prompt.attempt) this batch trained on.
                    "rollouts": [r["rollout_id"] for r in batch["rollouts"]]
                    if manager.step % g.inner_epochs == 0
                    else [],
                    "versions": sorted({r["version"] for r in batch["rollouts"]}),
                    "lease_s": round(t1 - t0, 4),
                    "compute_s": round(t2 - t1, 4),
                    "commit_s": round(t3 - t2, 4),
                    "t": time.time(),
                }
            )
            if acked and not finished:
                # Leave only at an acknowledged step: the controller counts the batch
                # trained and the state file holds it, so nothing is trained twice.
                orders.poll(manager.step)
                drained = orders.drain
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
        if ingest is not None:
            ingest.stop()
        weights.close()
        manager.close()
        client.close("drained" if drained else "finished")
        del store
    return 0

"""A policy slot of an RL job over decoupled DiLoCo (``[rl]`` with ``[diloco]``;
docs/architecture.md, "RL over DiLoCo"): GRPO inner steps on batches of its own,
an outer round through the object store every H inner steps, and nothing shared
with the other slots or the rollout replicas but storage and the controller's
small messages.

With S slots and H = ``diloco.sync_every``: slot k trains, at inner step h of
round r, the ledger's batch ``b = (r·H + h)·S + k`` (asked with
``BatchLeaseReq.batch``: the ledger freezes the indices in order, whoever asks
first). Round r's θ_global is weights version ``V_r = (r+1)·H·S``. Every slot
takes part in every round (the config makes ``min_replicas`` S), so once round
r is decided and applied, θ_global holds every batch below V_r: the slot saves
its state (:class:`~phalanx.jobs.slot_state.SlotState`, under
``<diloco.url>/<job id>.<ledger run>``: its durability) and
then acks V_r, which marks those batches trained (idempotent: the S acks of a
round move the ledger once). Every batch ask carries the version the slot's
θ_global holds, so an ack lost to a crash is made by the next ask.

A slot killed mid-round loses its uncommitted inner steps only: the round waits
for it (the controller's quorum of the round's members needs all S), the
launcher restarts it, it loads its state, catches up through any decided
round, and asks again for its batches of the round, which stay frozen until
acked: it trains the same rollouts again, and they count once.

Weights: when the controller orders a sync whose source is this slot (rank 0
of the newest policy quorum), it publishes θ_global, never its inner weights
(they hold its own partial round), with the version θ_global holds, to the
storage weight store the rollout replicas read.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable
from typing import Any

import torch

from phalanx.client import ControllerClient, QuorumTimeout
from phalanx.config import JobConfig
from phalanx.config.rl_diloco import round_batches
from phalanx.jobs import policy_end
from phalanx.jobs.base import JobError, ReplicaArgs
from phalanx.jobs.common import emit, job_store_name, keep_freed_memory
from phalanx.jobs.policy_ranks import Publisher
from phalanx.jobs.rl_policy import payloads_of
from phalanx.jobs.slot_state import SlotState, slot_exchange
from phalanx.protocol.rl import SyncOrder
from phalanx.rl.grpo import group_advantages, lr_lambda, rows_to_train
from phalanx.rl.model import build_model
from phalanx.rl.step import backward_rows, prepare
from phalanx.rl.tokenizer import task_tokenizer
from phalanx.rl.trainer import Rows, completions_of
from phalanx.tensorfile import save_file
from phalanx.train.base import JobFinished
from phalanx.train.diloco import DiLoCo
from phalanx.transport.factory import rollout_store, weight_channel
from phalanx.transport.replay import replay_reader

log = logging.getLogger("phalanx.jobs.rl_diloco")

NAME = re.compile(r"^(?:policy-|r)(\d+)$")
ASK_S = 5.0
"""Longest one batch ask is held open by the controller (asked again after)."""
ORDERS_S = 1.0
"""While a slot waits for a round's quorum, how often it looks for a sync order it
must serve (a rollout replica that joined waits for weights, and may be what the
round waits for: the other slot needs its rollouts)."""


def slot_of(name: str, replicas: int) -> int:
    """The slot a policy replica named ``policy-<k>`` (the launcher's) or ``r<k>`` is."""
    m = NAME.match(name)
    if m is None or int(m.group(1)) >= replicas:
        raise JobError(
            f"a policy replica of an RL job over DiLoCo must be named policy-<k> or r<k> with "
            f"k < diloco.replicas = {replicas} (each slot trains batches of its own): got "
            f"{name!r}."
        )
    return int(m.group(1))


def global_weights(model: torch.nn.Module, diloco: DiLoCo) -> dict[str, torch.Tensor]:
    """The model's state with θ_global in place of its parameters (tied ones included:
    they share a parameter's storage); buffers as the model holds them."""
    by_ptr = {p.data_ptr(): g for p, g in zip(diloco.params, diloco.global_params, strict=True)}
    out = {}
    for k, t in model.state_dict().items():
        g = by_ptr.get(t.data_ptr())
        out[k] = (g.detach().to(t.dtype) if g is not None else t.detach()).clone()
    return out


def run(args: ReplicaArgs) -> int:
    """One policy slot, until the ledger says the job is finished."""
    cfg = args.cfg
    if cfg.rl is None or cfg.diloco is None:
        raise JobError(
            "an RL DiLoCo slot needs a job config with [rl] and [diloco] sections: got "
            f"rl={'yes' if cfg.rl else 'none'}, diloco={'yes' if cfg.diloco else 'none'}."
        )
    keep_freed_memory()
    if cfg.rl.grpo.threads:
        torch.set_num_threads(cfg.rl.grpo.threads)
    torch.manual_seed(cfg.job.seed)
    return Slot(cfg, args).run()


class Slot:
    """Slot ``k`` of ``S`` (module doc). Who calls: one process per slot name at a time
    (the launcher restarts a failed one)."""

    def __init__(self, cfg: JobConfig, args: ReplicaArgs):
        assert cfg.rl is not None and cfg.diloco is not None  # run() checked
        self.cfg, self.rl, self.dc, self.g = cfg, cfg.rl, cfg.diloco, cfg.rl.grpo
        self.out = args.out
        self.k = slot_of(args.name, self.dc.replicas)
        self.slot = f"r{self.k}"
        self.n = round_batches(self.dc)
        self.steps = self.g.steps // self.dc.replicas
        """This slot's inner steps in the whole job."""
        self.client = ControllerClient(str(args.controller), "policy", args.name)
        self.device = torch.device(self.g.device)
        self.poll_orders: Callable[[], None] | None = None
        """Serve the sync order this slot is the source of, if any (set by the loop)."""

    def members(self, rnd: int) -> list[str]:
        """Round ``rnd``'s members: the controller's quorum of the policy slots, which
        is all S of them (``roles.policy.min_replicas``). Asked until it forms: a round
        decided by the deadline could leave out a slot that is restarting, and the
        acks of the round would then count its batches trained."""
        while True:
            if self.poll_orders is not None:
                self.poll_orders()
            try:
                q = self.client.quorum(rnd, ORDERS_S)
            except JobFinished:
                raise
            except QuorumTimeout:
                continue  # not all S slots yet: look for orders, then ask again
            except Exception as e:  # the controller restarts: ask again
                log.warning("no quorum for round %d yet (%s); asking again", rnd, e)
                time.sleep(ORDERS_S)
                continue
            return sorted(f"r{slot_of(m.name, self.dc.replicas)}" for m in q.members)

    def run(self) -> int:
        c = self.client
        c.register()
        st = c.status()
        if st.rl is not None and st.rl.finished:
            policy_end.joined_finished(c)
            return 0
        c.start_heartbeat()
        try:
            return self._run()
        finally:
            c.close("finished")

    def _run(self) -> int:
        g, dc, c = self.g, self.dc, self.client
        tok = task_tokenizer(self.rl.task)
        model = prepare(build_model(self.rl.model, tok, self.device).train(), g)
        ref = None
        if g.kl_coef:
            ref = build_model(self.rl.model, tok, self.device).eval().requires_grad_(False)
        opt = torch.optim.AdamW(
            model.parameters(), lr=g.lr, betas=g.betas, weight_decay=g.weight_decay
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(g, self.steps))
        # The rounds and slot states of this run of the job (the ledger's run, which a
        # restarted controller keeps): a rerun on the same diloco.url starts afresh
        # instead of resuming slots the new ledger never heard of.
        name = job_store_name(self.cfg.job.id, c)
        dc = dc.model_copy(update={"url": f"{dc.url.rstrip('/')}/{name}"})
        exchange = slot_exchange(dc, self.slot, self.members)
        diloco = DiLoCo(model, dc.outer(), exchange)
        state = SlotState(dc, self.slot, diloco, exchange, self.steps)

        def load(own: dict[str, Any]) -> None:
            model.load_state_dict(own["model"])
            opt.load_state_dict(own["optimizer"])
            sched.load_state_dict(own["scheduler"])
            diloco.load_state_dict(own["diloco"])

        state.restore(load)
        payloads = rollout_store(self.rl.transport, name)
        replay = replay_reader(self.rl.transport, name)
        if payloads is None:  # the config refuses it: the slots share no controller store
            raise JobError("rl.transport.rollouts must be a storage URL with [diloco].")
        timeout = self.rl.loop.sync_timeout_s
        weights = weight_channel(self.rl.transport, self.cfg.job.id, timeout, self.device)
        publisher = Publisher(c, weights, True)
        emit(
            {
                "event": "start",
                "role": "policy",
                "replica": c.replica_id,
                "slot": self.slot,
                "pid": os.getpid(),
                "round": diloco.rounds,
                "caught_up": state.caught_up,
                "adopted_from": state.adopted_from,
            }
        )

        def serve(order: SyncOrder | None) -> None:
            if order is None or order.rank != 0 or order.seq <= publisher.published:
                return
            publisher.published = order.seq
            weights.publish(
                diloco.rounds * self.n, global_weights(model, diloco), order, publisher.report
            )

        def poll_orders() -> None:
            # An ack of the version θ_global holds (idempotent; its save is done)
            # answers with the order this slot must serve.
            try:
                version = diloco.rounds * self.n
                serve(c.ack_batch(version, durable=version).sync)
            except Exception as e:  # the controller restarts: the next poll asks again
                log.warning("no sync order read (%s)", e)

        self.poll_orders = poll_orders
        finished = False
        try:
            while not finished and diloco.inner_steps < self.steps:
                h = diloco.inner_steps % dc.sync_every
                b = (diloco.rounds * dc.sync_every + h) * dc.replicas + self.k
                version = diloco.rounds * self.n
                rows: Rows | None = None
                while rows is None and not finished:
                    r = c.lease_batch(version, ASK_S, version, batch=b)
                    serve(r.sync)
                    finished = r.finished
                    if r.batch is None:
                        continue
                    got, lost = payloads_of(r.batch, payloads, self.rl, replay)
                    if lost:  # discarded, their prompts dispatched again; b frozen anew
                        c.lost_payloads(lost)
                        continue
                    rows = got
                if rows is None:
                    break
                stats = self._inner_step(model, ref, opt, rows, tok.pad_id)
                sched.step()
                emit(
                    {
                        "event": "inner_step",
                        "role": "policy",
                        "replica": c.replica_id,
                        "slot": self.slot,
                        "batch": b,
                        "rollouts": [x.rollout_id for x in r.batch.rollouts if not x.replayed]
                        if r.batch is not None
                        else [],
                        "loss": round(stats.get("loss", 0.0), 6),
                        "t": time.time(),
                    }
                )
                if not diloco.after_inner_step():
                    continue
                members = exchange.last_members
                if self.slot not in members:
                    # Every slot is in every round (config): its batches would be acked
                    # as trained while θ_global does not hold them.
                    raise JobError(
                        f"round {diloco.rounds - 1} was decided without {self.slot} "
                        f"(members {members}): every slot must take part in every round "
                        f"of an RL job; raise diloco.round_timeout_s."
                    )
                state.save(
                    {
                        "model": model.state_dict(),
                        "optimizer": opt.state_dict(),
                        "scheduler": sched.state_dict(),
                        "diloco": diloco.state_dict(),
                    }
                )
                version = diloco.rounds * self.n
                a = c.ack_batch(version, durable=version)
                serve(a.sync)
                finished = a.finished
                emit(
                    {
                        "event": "step",
                        "role": "policy",
                        "replica": c.replica_id,
                        "slot": self.slot,
                        "step": version,
                        "round": diloco.rounds,
                        "members": members,
                        "bytes_sent": exchange.bytes_sent,
                        "bytes_read": exchange.bytes_read,
                        "t": time.time(),
                    }
                )
            finished = self._finish(c, diloco, serve) or finished
            if weights.pending is not None:  # the rollout replicas wait for that version
                weights.pending.result(timeout=timeout * 2)
            if self.out is not None:
                out = {f"model.{k}": v for k, v in global_weights(model, diloco).items()}
                save_file(out, self.out, metadata={"step": str(diloco.rounds * self.n)})
            emit(
                {
                    "event": "done",
                    "role": "policy",
                    "replica": c.replica_id,
                    "slot": self.slot,
                    "step": diloco.rounds * self.n,
                    "finished": finished,
                }
            )
        finally:
            payloads.close()
            weights.close()
        return 0

    def _finish(self, c: ControllerClient, diloco: DiLoCo, serve: Any) -> bool:
        """After the last round: ack it until the ledger says the job is finished (the
        last ack of another slot, or a sync this slot must still serve, may be due)."""
        version = diloco.rounds * self.n
        while True:
            a = c.ack_batch(version, durable=version)
            serve(a.sync)
            if a.finished:
                return True
            # An index past the job's last batch: waits for news, never freezes one.
            r = c.lease_batch(version, ASK_S, version, batch=max(version, self.g.steps))
            serve(r.sync)
            if r.finished:
                return True

    def _inner_step(
        self, model: Any, ref: Any, opt: torch.optim.Optimizer, rows: Rows, pad_id: int
    ) -> dict[str, float]:
        """One GRPO optimizer step on this slot's batch (as :mod:`phalanx.jobs.rl_single`)."""
        g = self.g
        comps, rewards = completions_of(rows)
        adv = group_advantages(torch.tensor(rewards), g.group_size, g.adv_eps)
        keep = rows_to_train(adv, g.kl_coef)
        opt.zero_grad(set_to_none=True)
        n_tokens = sum(x.trained_tokens() for x in comps)
        stats = backward_rows(
            model, comps, adv, keep, g=g, pad_id=pad_id, num_tokens=n_tokens, ref=ref
        )
        if g.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), g.grad_clip)
        opt.step()
        return stats

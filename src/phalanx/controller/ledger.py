"""The RL ledger: prompt leases, rollouts, training batches and weight syncs.

Part of the controller's pure state machine (no I/O, no clock: every call
takes ``now``/``wall``), journaled through the same ``(table, key, record)``
changes as membership. Units:

- a **prompt** is an index into the task's prompt stream; the controller owns
  the cursor. A rollout replica *leases* a few prompts with a deadline.
- a **rollout** is the group of ``group_size`` completions of one prompt,
  with rewards, behaviour log-probs and the weights version that made it.
  Its id is ``p<prompt>.<attempt>``: the attempt grows only when a rollout
  of the prompt is discarded and the prompt is dispatched again, so a late
  submission of the same prompt (from an expired lease) is a duplicate and
  is dropped by id.
- a **batch** is the ``prompts_per_step`` rollouts one policy step trains on.
  It is frozen the first time a policy replica asks for that step, so every
  member of the quorum (and a retry after a failed commit) gets the same
  batch; it is acknowledged when the step commits.

Where each prompt is, at every moment (``balance()`` checks it)::

    issued (cursor) = queued + leased + done + trained
    accepted rollouts = pending + batched + trained + discarded (by reason)

A weights **version** is the policy's committed step count. After every
``sync_every`` commits the ledger orders a sync: the policy leader
broadcasts its newest snapshot to every live rollout replica (the mesh). At
most one sync is in flight; a mesh change (join, eviction, new leader) makes
the next sync rebuild the group (``mesh_id`` changes) and brings joiners up
to date before they may lease prompts.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from phalanx.rl.config import RLConfig

Put = Callable[[str, str, dict[str, Any] | None], None]
Event = Callable[..., None]


class LedgerError(ValueError):
    """A ledger request refused (mapped to 4xx by the state machine's caller)."""

    def __init__(self, message: str, field: str | None = None, status: int = 400):
        super().__init__(message)
        self.field, self.status = field, status


@dataclass
class Lease:
    lease_id: str
    replica_id: str
    prompts: list[int]
    version: int
    issued_at: float
    deadline: float = field(default=0.0, compare=False)
    """Monotonic; not durable (a restored lease gets a fresh deadline)."""

    def record(self) -> dict[str, Any]:
        d = asdict(self)
        del d["deadline"]
        return d


@dataclass
class Prompt:
    index: int
    attempt: int = 0
    state: str = "queued"
    """queued | leased | done (a rollout is pending or batched)."""
    lease_id: str | None = None

    @property
    def rollout_id(self) -> str:
        return f"p{self.index}.{self.attempt}"


@dataclass
class Sync:
    seq: int
    mesh_id: int
    members: list[str]
    """Policy leader first, then the rollout replicas (rank = position)."""
    store: str
    """The leader's rendezvous address."""
    ordered_at: float
    ordered_mono: float = field(default=0.0, compare=False)
    done: dict[str, int] = field(default_factory=dict)
    """Members that finished, with the version they now hold."""

    def record(self) -> dict[str, Any]:
        d = asdict(self)
        del d["ordered_mono"]
        return d


def rollout_prompt(rollout_id: str) -> tuple[int, int]:
    """``p<prompt>.<attempt>`` -> (prompt, attempt); LedgerError if malformed."""
    try:
        p, a = rollout_id.removeprefix("p").split(".")
        # Canonical only: int() also takes " 1", "01", "1_0" and "+1", and a second
        # spelling of one prompt attempt would be recorded under a key of its own.
        if rollout_id != f"p{int(p)}.{int(a)}" or int(p) < 0 or int(a) < 0:
            raise ValueError
        return int(p), int(a)
    except ValueError:
        raise LedgerError(
            f"rollout_id must look like p<prompt>.<attempt> as the lease gave it: got "
            f"{rollout_id!r}.",
            field="rollouts.rollout_id",
        ) from None


class Ledger:
    """Prompt dispatch, the rollout ledger and weight-sync orders of one RL job."""

    def __init__(self, rl: RLConfig, put: Put, event: Event, sync_timeout_s: float = 60.0):
        self.rl = rl
        self.sync_timeout_s = sync_timeout_s
        self.loop, self.grpo = rl.loop, rl.grpo
        self._put, self._event = put, event
        self.run = uuid.uuid4().hex[:12]
        """This run of the job (journaled: a restarted controller keeps it). Rollout ids
        restart at p0.0 in every fresh run, so queues outside the controller (Redis, a
        spool) keep runs apart under it, or a rerun's rollouts would look like duplicates."""
        self.cursor = 0
        self.prompts: dict[int, Prompt] = {}
        self.requeue: deque[int] = deque()
        self.leases: dict[str, Lease] = {}
        self.lease_seq = 0
        self.pending: dict[str, dict[str, Any]] = {}
        """Accepted rollouts not yet in a batch, in arrival order."""
        self.batches: dict[int, dict[str, Any]] = {}
        self.rollouts: dict[str, dict[str, Any]] = {}
        """Payloads of pending and batched rollouts, by id."""
        self.seq = 0
        self.next_batch = 0
        self.policy_step = 0
        self.counts: dict[str, int] = {
            "trained_prompts": 0,
            "trained_rollouts": 0,
            "trained_completions": 0,
            "accepted": 0,
            "duplicates": 0,
            "leases_issued": 0,
            "leases_expired": 0,
        }
        self.discarded: dict[str, int] = {}
        self.history: list[dict[str, Any]] = []
        self.finished = False
        # weight sync
        self.want_version = 0
        self.synced_version = 0
        """Newest version a completed sync delivered (0: the init weights, from config)."""
        self.sync: Sync | None = None
        self.sync_seq = 0
        self.mesh_id = 0
        self.mesh: list[str] = []
        self.source_busy: tuple[str, int] | None = None
        """(leader, seq) of the last order until the leader reports it (not durable)."""
        self.versions: dict[str, int] = {}
        """Weights version each rollout replica last declared (not durable)."""

    # -- persistence -----------------------------------------------------

    def _save_meta(self) -> None:
        self._put(
            "ledger",
            "meta",
            {
                "cursor": self.cursor,
                "lease_seq": self.lease_seq,
                "seq": self.seq,
                "next_batch": self.next_batch,
                "policy_step": self.policy_step,
                "counts": self.counts,
                "discarded": self.discarded,
                "finished": self.finished,
                "want_version": self.want_version,
                "synced_version": self.synced_version,
                "sync_seq": self.sync_seq,
                "mesh_id": self.mesh_id,
                "mesh": self.mesh,
                "requeue": list(self.requeue),
                "run": self.run,
            },
        )

    def _save_prompt(self, p: Prompt) -> None:
        self._put("prompts", str(p.index), asdict(p))

    def restore(self, tables: dict[str, dict[str, dict[str, Any]]], now: float) -> None:
        meta = tables.get("ledger", {}).get("meta")
        if meta is None:
            return
        for k in ("cursor", "lease_seq", "seq", "next_batch", "policy_step", "finished"):
            setattr(self, k, meta[k])
        for k in ("want_version", "synced_version", "sync_seq", "mesh_id", "mesh"):
            setattr(self, k, meta[k])
        self.counts.update(meta["counts"])
        self.discarded = dict(meta["discarded"])
        self.requeue = deque(meta["requeue"])
        self.run = meta.get("run", self.run)
        for rec in tables.get("prompts", {}).values():
            self.prompts[rec["index"]] = Prompt(**rec)
        for rec in tables.get("leases", {}).values():
            self.leases[rec["lease_id"]] = Lease(**rec, deadline=now + self.loop.lease_s)
        rolls = tables.get("rollouts", {})
        self.rollouts = dict(rolls)
        for key in sorted(tables.get("batches", {}), key=int):
            b = tables["batches"][key]
            self.batches[b["index"]] = b
        batched = {rid for b in self.batches.values() for rid in b["rollout_ids"]}
        for rid, rec in sorted(rolls.items(), key=lambda kv: kv[1]["seq"]):
            if rid not in batched:
                self.pending[rid] = rec
        hist = tables.get("rl_history", {})
        self.history = [hist[k] for k in sorted(hist, key=int)]
        # An in-flight sync is not restored: its members either finished it or
        # will fail it; the next order rebuilds from the journaled mesh.

    # -- accounting ------------------------------------------------------

    def balance(self) -> dict[str, Any]:
        """Where every prompt and rollout is. ``ok`` is the ledger's invariant."""
        states = {"queued": 0, "leased": 0, "done": 0}
        for p in self.prompts.values():
            states[p.state] += 1
        batched = sum(len(b["rollout_ids"]) for b in self.batches.values())
        c = self.counts
        discarded = sum(self.discarded.values())
        prompts_ok = self.cursor == sum(states.values()) + c["trained_prompts"]
        rollouts_ok = (
            c["accepted"] == len(self.pending) + batched + c["trained_rollouts"] + discarded
        )
        return {
            "ok": prompts_ok and rollouts_ok,
            "prompts": {"issued": self.cursor, **states, "trained": c["trained_prompts"]},
            "rollouts": {
                "accepted": c["accepted"],
                "pending": len(self.pending),
                "batched": batched,
                "trained": c["trained_rollouts"],
                "discarded": dict(self.discarded),
                "duplicates_dropped": c["duplicates"],
            },
            "leases": {
                "open": len(self.leases),
                "issued": c["leases_issued"],
                "expired": c["leases_expired"],
            },
        }

    def _discard(self, rid: str, reason: str, wall: float) -> None:
        """Drop an accepted rollout and dispatch its prompt again (next attempt)."""
        rec = self.rollouts.pop(rid)
        self.pending.pop(rid, None)
        self._put("rollouts", rid, None)
        self.discarded[reason] = self.discarded.get(reason, 0) + 1
        p = self.prompts[rec["prompt"]]
        p.attempt += 1
        p.state, p.lease_id = "queued", None
        self.requeue.append(p.index)
        self._save_prompt(p)
        self._event(
            "rollout_discarded", wall, rollout_id=rid, reason=reason, version=rec["version"]
        )

    # -- prompt leases (rollout replicas) --------------------------------

    def _floor(self) -> int:
        """Oldest version a rollout leased now may be made with and still train."""
        return self.next_batch * self.grpo.inner_epochs - self.loop.max_staleness

    def init_allowed(self) -> bool:
        """Whether a replica with no weights may build version 0 from config itself."""
        return self.synced_version == 0 and self.want_version == 0

    def lease(
        self, replica_id: str, version: int, max_prompts: int, *, now: float, wall: float
    ) -> Lease | None:
        """Lease up to ``max_prompts`` prompts to a rollout replica holding ``version``
        (-1: no weights yet). None when the job is finished, when the replica's
        weights are too old (it must sync first), or under backpressure."""
        self.versions[replica_id] = version
        if self.finished or version < 0 or version < self._floor():
            return None
        idx: list[int] = []
        popped = bool(self.requeue)
        # Prompts dispatched again come first, whatever the backpressure: they are
        # already counted as outstanding, so holding them back could only stall.
        while self.requeue and len(idx) < max_prompts:
            i = self.requeue.popleft()
            p = self.prompts.get(i)
            if p is not None and p.state == "queued" and i not in idx:
                idx.append(i)
        outstanding = sum(1 for p in self.prompts.values() if p.state != "done") + len(self.pending)
        room = self.loop.max_ahead * self.grpo.prompts_per_step - outstanding
        for _ in range(min(max_prompts - len(idx), room)):
            idx.append(self.cursor)
            self.prompts[self.cursor] = Prompt(self.cursor)
            self.cursor += 1
        if not idx:
            if popped:  # dropped entries of prompts no longer queued: journal that
                self._save_meta()
            return None
        self.lease_seq += 1
        lease = Lease(f"L{self.lease_seq}", replica_id, idx, version, wall, now + self.loop.lease_s)
        self.leases[lease.lease_id] = lease
        for i in idx:
            p = self.prompts[i]
            p.state, p.lease_id = "leased", lease.lease_id
            self._save_prompt(p)
        self.counts["leases_issued"] += 1
        self._put("leases", lease.lease_id, lease.record())
        self._save_meta()
        return lease

    def _end_lease(self, lease: Lease, wall: float, reason: str) -> None:
        """Return a lease's unsubmitted prompts to the front of the queue."""
        del self.leases[lease.lease_id]
        self._put("leases", lease.lease_id, None)
        back = []
        for i in lease.prompts:
            p = self.prompts.get(i)
            if p is not None and p.state == "leased" and p.lease_id == lease.lease_id:
                p.state, p.lease_id = "queued", None
                self._save_prompt(p)
                back.append(i)
        if back:
            self.requeue.extendleft(reversed(back))
            self.counts["leases_expired"] += 1
            self._event(
                "lease_expired",
                wall,
                lease_id=lease.lease_id,
                replica_id=lease.replica_id,
                prompts=len(back),
                indices=back,
                reason=reason,
            )
        self._save_meta()

    def expire(self, now: float, wall: float) -> bool:
        """Dispatch again the prompts of leases past their deadline. True if any."""
        late = [le for le in self.leases.values() if le.deadline <= now]
        for le in late:
            self._end_lease(le, wall, "deadline passed")
        return bool(late)

    def drop_replica(self, replica_id: str, wall: float) -> bool:
        """A replica left or was evicted: its leases go back at once (no waiting for
        the deadline), and an in-flight sync that counts on it is abandoned."""
        self.versions.pop(replica_id, None)
        mine = [le for le in self.leases.values() if le.replica_id == replica_id]
        for le in mine:
            self._end_lease(le, wall, f"holder {replica_id} gone")
        if self.sync is not None and replica_id in self.sync.members:
            self._fail_sync(f"member {replica_id} gone", wall)
        return bool(mine)

    def submit(
        self,
        replica_id: str,
        lease_id: str,
        rollouts: list[dict[str, Any]],
        *,
        now: float,
        wall: float,
    ) -> dict[str, list[str]]:
        """Record a lease's rollouts. Each is accepted once by id; a later copy (late
        submission of an expired lease, a retry) is dropped as a duplicate, and one
        made with too old weights is discarded as stale. Validates everything
        before recording anything."""
        g = self.grpo
        for k, r in enumerate(rollouts):
            rollout_prompt(r["rollout_id"])
            comps = r["completions"]
            if len(comps) != g.group_size:
                raise LedgerError(
                    f"rollouts[{k}].completions must hold group_size={g.group_size} "
                    f"completions: got {len(comps)}. Submit every sample of the group.",
                    field=f"rollouts.{k}.completions",
                )
            for j, c in enumerate(comps):
                if len(c["token_ids"]) != len(c["logprobs"]) or not c["token_ids"]:
                    raise LedgerError(
                        f"rollouts[{k}].completions[{j}] must have one log-prob per token and "
                        f"at least one token: got {len(c['token_ids'])} tokens, "
                        f"{len(c['logprobs'])} log-probs.",
                        field=f"rollouts.{k}.completions.{j}",
                    )
                if len(c["token_ids"]) > g.max_new_tokens:
                    raise LedgerError(
                        f"rollouts[{k}].completions[{j}] must have at most max_new_tokens="
                        f"{g.max_new_tokens} tokens: got {len(c['token_ids'])}.",
                        field=f"rollouts.{k}.completions.{j}.token_ids",
                    )
        out: dict[str, list[str]] = {"accepted": [], "duplicate": [], "stale": []}
        lease = self.leases.get(lease_id)
        floor = self._floor()
        for r in rollouts:
            rid = r["rollout_id"]
            idx, attempt = rollout_prompt(rid)
            p = self.prompts.get(idx)
            if p is None or p.attempt != attempt or p.state == "done":
                self.counts["duplicates"] += 1
                out["duplicate"].append(rid)
                continue
            if p.lease_id is not None and p.lease_id in self.leases:
                other = self.leases[p.lease_id]
                if other is not lease:
                    other.prompts.remove(idx)
                    if other.prompts:
                        self._put("leases", other.lease_id, other.record())
                    else:  # nothing left to submit: its holder is no longer busy
                        del self.leases[other.lease_id]
                        self._put("leases", other.lease_id, None)
            p.state, p.lease_id = "done", None
            self._save_prompt(p)
            self.seq += 1
            rec = {
                "rollout_id": rid,
                "prompt": idx,
                "version": int(r["version"]),
                "replica_id": replica_id,
                "seq": self.seq,
                "reward": float(r["reward"]),
                "exact_match": float(r["exact_match"]),
                "completions": r["completions"],
            }
            self.rollouts[rid] = self.pending[rid] = rec
            self._put("rollouts", rid, rec)
            self.counts["accepted"] += 1
            if rec["version"] < floor:
                self._discard(rid, "stale", wall)
                out["stale"].append(rid)
            else:
                out["accepted"].append(rid)
        if lease is not None and all(
            i not in self.prompts or self.prompts[i].state == "done" for i in lease.prompts
        ):
            del self.leases[lease_id]
            self._put("leases", lease_id, None)
        self._save_meta()
        return out

    # -- training batches (policy replicas) ------------------------------

    def batch_for(self, step: int, *, wall: float) -> dict[str, Any] | None:
        """The frozen batch that policy step ``step`` trains on, freezing it from the
        oldest pending rollouts if this is the first ask. None: not enough fresh
        rollouts yet (ask again). Rollouts too old for the batch are discarded."""
        b = step // self.grpo.inner_epochs
        if b in self.batches:
            return self.batches[b]
        if self.finished:
            return None  # a finished job is not rewound: nothing more will train
        if b < self.next_batch:
            # Every replica that trained batch b is gone and the state went with
            # them: training restarts from an older step and gets fresh batches.
            self._event("policy_rewind", wall, from_batch=self.next_batch, to_batch=b)
            self.next_batch = b
            self.policy_step = min(self.policy_step, step)
            self.want_version = min(self.want_version, step)
            self.synced_version = min(self.synced_version, step)
            # The metrics of the lost training go too: the journal keys history by
            # batch, so a retrained batch would overwrite its entry there but not
            # here, and the finish test must only average the surviving lineage.
            while self.history and self.history[-1]["batch"] >= b:
                self._put("rl_history", str(self.history.pop()["batch"]), None)
            # Batches the lost replicas froze ahead are unfrozen, so that next_batch
            # stays past every frozen batch (else a later ask would freeze a second
            # batch under an index already used) and their rollouts, oldest first,
            # go through the staleness check of the new lineage.
            for k in [k for k in self.batches if k > b]:
                for rid in self.batches.pop(k)["rollout_ids"]:
                    self.pending[rid] = self.rollouts[rid]
                self._put("batches", str(k), None)
            self.pending = dict(sorted(self.pending.items(), key=lambda kv: kv[1]["seq"]))
        floor = b * self.grpo.inner_epochs - self.loop.max_staleness
        for rid in [rid for rid, r in self.pending.items() if r["version"] < floor]:
            self._discard(rid, "stale", wall)
        need = self.grpo.prompts_per_step
        if len(self.pending) < need:
            self._save_meta()
            return None
        ids = list(self.pending)[:need]
        rows = [self.pending.pop(rid) for rid in ids]
        batch = {
            "index": b,
            "step": step,
            "rollout_ids": ids,
            "frozen_at": wall,
            "reward": sum(r["reward"] for r in rows) / need,
            "exact_match": sum(r["exact_match"] for r in rows) / need,
            "staleness": b * self.grpo.inner_epochs - min(r["version"] for r in rows),
        }
        self.batches[b] = batch
        self.next_batch = max(self.next_batch, b + 1)
        self._put("batches", str(b), batch)
        self._save_meta()
        return batch

    def ack(self, step: int, *, wall: float) -> bool:
        """Policy step count ``step`` is committed: every batch it covers is trained.
        Returns True when this moved the ledger (idempotent per step)."""
        if step <= self.policy_step and not any(
            (b + 1) * self.grpo.inner_epochs <= step for b in self.batches
        ):
            return False
        self.policy_step = max(self.policy_step, step)
        for b in sorted(self.batches):
            if (b + 1) * self.grpo.inner_epochs > step:
                continue
            batch = self.batches.pop(b)
            self._put("batches", str(b), None)
            for rid in batch["rollout_ids"]:
                rec = self.rollouts.pop(rid)
                self._put("rollouts", rid, None)
                p = self.prompts.pop(rec["prompt"])
                self._put("prompts", str(p.index), None)
                self.counts["trained_prompts"] += 1
                self.counts["trained_rollouts"] += 1
                self.counts["trained_completions"] += len(rec["completions"])
            self._record(batch, wall)
        self.want_version = max(self.want_version, step - step % self.loop.sync_every)
        self._save_meta()
        return True

    def _record(self, batch: dict[str, Any], wall: float) -> None:
        w = self.loop.window
        prev = self.history[-(w - 1) :] if w > 1 else []  # history[-0:] would be all of it
        recent = [h["exact_match"] for h in prev] + [batch["exact_match"]]
        recent_r = [h["reward"] for h in prev] + [batch["reward"]]
        h = {
            "batch": batch["index"],
            "step": self.policy_step,
            "reward": round(batch["reward"], 5),
            "exact_match": round(batch["exact_match"], 5),
            "reward_avg": round(sum(recent_r) / len(recent_r), 5),
            "exact_match_avg": round(sum(recent) / len(recent), 5),
            "staleness": batch["staleness"],
            "at": wall,
        }
        self.history.append(h)
        self._put("rl_history", str(batch["index"]), h)
        while len(self.history) > self.loop.history:
            old = self.history.pop(0)
            self._put("rl_history", str(old["batch"]), None)
        target = self.loop.target_exact_match
        if not self.finished and (
            (target is not None and len(recent) == w and h["exact_match_avg"] >= target)
            or (
                self.loop.target_reward is not None
                and len(recent) == w
                and h["reward_avg"] >= self.loop.target_reward
            )
            or batch["index"] + 1 >= self.grpo.steps
        ):
            self.finished = True
            self._event(
                "rl_finished",
                wall,
                batch=batch["index"],
                step=self.policy_step,
                exact_match_avg=h["exact_match_avg"],
            )

    # -- weight sync -----------------------------------------------------

    def maybe_sync(
        self, leader: tuple[str, str] | None, rollout_ids: Iterable[str], *, now: float, wall: float
    ) -> Sync | None:
        """Order a sync if none is in flight and an idle rollout replica needs newer
        weights (a commit reached ``want_version``, or a joiner has none). The mesh is
        the leader and those replicas. ``leader`` is the policy leader's (replica id,
        rendezvous address). Returns the new order."""
        if self.sync is not None:
            if now - self.sync.ordered_mono > self.sync_timeout_s:
                self._fail_sync("timed out", wall)
            else:
                return None
        if leader is not None and self.source_busy is not None:
            if self.source_busy[0] == leader[0]:
                return None  # the leader still sends (or times out) the previous one
            self.source_busy = None  # that leader is gone
        rollouts = sorted(rollout_ids)
        if self.finished or leader is None or not rollouts or self.init_allowed():
            return None  # nothing newer than the init weights every replica can build
        target = max(self.want_version, self.synced_version)
        # Only replicas between two generation batches (holding no lease) take part:
        # a broadcast waits for its slowest member, and one replica busy generating
        # must not hold back the weights of all the others (nor the policy, which
        # waits for fresh rollouts). A busy one joins the next sync.
        busy = {le.replica_id for le in self.leases.values()}
        # And only replicas that asked for prompts since they (re)started or failed a
        # sync: one still loading its model would hold the broadcast until it times out.
        behind = [r for r in rollouts if r not in busy and self.versions.get(r, target) < target]
        if not behind:
            return None
        members = [leader[0], *behind]
        if members != self.mesh:
            self.mesh_id += 1
            self.mesh = members
        self.sync_seq += 1
        self.sync = Sync(self.sync_seq, self.mesh_id, members, leader[1], wall, now)
        self.source_busy = (leader[0], self.sync_seq)
        self._save_meta()
        self._event(
            "sync_ordered",
            wall,
            seq=self.sync_seq,
            mesh_id=self.mesh_id,
            members=len(members),
            want_version=self.want_version,
        )
        return self.sync

    def _fail_sync(self, reason: str, wall: float) -> None:
        assert self.sync is not None
        self._event("sync_failed", wall, seq=self.sync.seq, reason=reason)
        # Members that have not reported may still be inside the failed broadcast: leave
        # them out of the next order until they ask for prompts again (declaring their
        # version), or they would stall it in turn.
        for rid in self.sync.members[1:]:
            if rid not in self.sync.done:
                self.versions.pop(rid, None)
        self.sync = None
        self.mesh = []  # rebuild the group: some member's communicator is broken
        # Journaled: a restart must not revive the broken mesh (and reuse its mesh_id).
        self._save_meta()

    def sync_done(
        self, replica_id: str, seq: int, version: int, ok: bool, error: str, *, wall: float
    ) -> bool:
        """A mesh member finished sync ``seq`` (``ok``) or failed it. True when the sync
        completed or failed as a whole (the caller may order the next one)."""
        freed = self.source_busy == (replica_id, seq)
        if freed:
            self.source_busy = None  # the leader's sender is free for the next order
        s = self.sync
        if s is None or s.seq != seq or replica_id not in s.members:
            return freed  # an old or abandoned sync: only a freed leader is news
        if not ok:
            self._fail_sync(f"{replica_id}: {error[:200]}", wall)
            return True
        s.done[replica_id] = version
        if replica_id != s.members[0]:  # versions are the rollout replicas'
            self.versions[replica_id] = version
        if len(s.done) < len(s.members):
            return False
        v = min(s.done.values())
        self.synced_version = max(self.synced_version, v)
        self._event("sync_done", wall, seq=s.seq, version=v, members=len(s.members))
        self.sync = None
        self._save_meta()
        return True

    def sync_for(self, replica_id: str) -> dict[str, Any] | None:
        """The in-flight sync order, if ``replica_id`` must take part and has not yet."""
        s = self.sync
        if s is None or replica_id not in s.members or replica_id in s.done:
            return None
        return {
            "seq": s.seq,
            "mesh_id": s.mesh_id,
            "members": s.members,
            "rank": s.members.index(replica_id),
            "store": s.store,
        }

    # -- status ----------------------------------------------------------

    def status(self) -> dict[str, Any]:
        last = self.history[-1] if self.history else None
        return {
            **self.balance(),
            "policy_step": self.policy_step,
            "next_batch": self.next_batch,
            "run": self.run,
            "leased_by": {
                rid: sum(len(le.prompts) for le in self.leases.values() if le.replica_id == rid)
                for rid in sorted({le.replica_id for le in self.leases.values()})
            },
            "finished": self.finished,
            "last": last,
            "history": self.history[-200:],
            "weights": {
                "want_version": self.want_version,
                "synced_version": self.synced_version,
                "mesh_id": self.mesh_id,
                "sync_in_flight": self.sync.record() if self.sync else None,
                "versions": dict(sorted(self.versions.items())),
            },
        }

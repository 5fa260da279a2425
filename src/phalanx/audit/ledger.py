"""An RL job's ledger, rebuilt from the journal, and the policy's audit trail.

The controller's ledger (:mod:`phalanx.controller.core.ledger`) keeps the books of
every prompt and rollout; :meth:`~phalanx.controller.core.ledger.Ledger.balance`
says whether they balance (``ok``). The audit rebuilds the ledger from the journal's
tables exactly as a restarted controller does (``ControllerState.restore``), with no
controller running.

The policy's ``step`` lines list the rollouts of each batch it acknowledged
(``batch``, ``rollouts``). A batch acknowledged in a quorum that a later rollback
went below is outside the lineage (DESIGN.md: "trained" means in the lineage) and
may be trained again; any other prompt or rollout seen in two batches was trained
twice.
"""

from __future__ import annotations

import time
from typing import Any

from phalanx.audit.base import Check, Run


def _restored_balance(run: Run) -> dict[str, Any] | None:
    from phalanx.controller import ledger_balance

    return ledger_balance(run.config, run.journal or {}, time.monotonic())


def lineage_batches(run: Run) -> dict[int, list[str]]:
    """The rollouts of each batch the policy acknowledged within the lineage, by batch.
    A batch acknowledged at two commits (two quorums, or two steps) in the lineage
    lists its rollouts twice: they were trained twice."""
    out: dict[int, list[str]] = {}
    acks: set[tuple[int, int, int]] = set()
    for e in run.steps():
        if not e.get("rollouts"):
            continue
        q, step, batch = int(e.get("quorum_id", 0)), int(e["step"]), int(e["batch"])
        if any(rb.quorum_id > q and rb.to_step < step for rb in run.rollbacks):
            continue  # taken back by a rollback: not trained
        if (q, step, batch) in acks:
            continue  # the same commit's line, printed again
        acks.add((q, step, batch))
        out.setdefault(batch, []).extend(e["rollouts"])
    return out


def prompt_of(rollout_id: str) -> int:
    """``p12.3`` -> 12: the prompt a rollout answers."""
    return int(rollout_id[1:].split(".")[0])


def check_balance(run: Run) -> Check:
    """The ledger, rebuilt from the journal, balances; its trained rollouts, and its
    trained prompts (one rollout each), are those of the batches the policy's logs
    acknowledged."""
    c = Check("ledger.balance", "")
    if not run.rl:
        c.skipped = "not an RL job (no ledger)"
        return c
    if run.journal is None:
        c.skipped = "no controller/journal.sqlite (an etcd journal lives outside the run dir)"
        return c
    bal = _restored_balance(run)
    if bal is None:
        c.problems.append("the journal holds no ledger for an RL job")
        return c
    p, r = bal["prompts"], bal["rollouts"]
    if not bal["ok"]:
        c.problems.append(f"the ledger does not balance: prompts {p}, rollouts {r}")
    batches = lineage_batches(run)
    trained = sum(len(v) for v in batches.values())
    if r["trained"] != trained:
        c.problems.append(
            f"the ledger counts {r['trained']} rollouts trained, the policy's logs {trained}"
        )
    if p["trained"] != trained:  # a prompt is trained through its one rollout (a group)
        c.problems.append(
            f"the ledger counts {p['trained']} prompts trained, the policy's logs {trained} "
            f"(one rollout a prompt)"
        )
    c.what = (
        f"balanced: {p['issued']} prompts issued, {r['accepted']} rollouts accepted, "
        f"{r['trained']} trained, {sum(r['discarded'].values())} discarded"
    )
    return c


def check_trained_once(run: Run) -> Check:
    """No rollout and no prompt was trained twice (in the lineage)."""
    c = Check("ledger.trained_once", "")
    if not run.rl:
        c.skipped = "not an RL job"
        return c
    batches = lineage_batches(run)
    seen_r: dict[str, int] = {}
    seen_p: dict[int, int] = {}
    for b, rollouts in sorted(batches.items()):
        for rid in rollouts:
            if rid in seen_r:
                c.problems.append(f"rollout {rid} trained in batches {seen_r[rid]} and {b}")
            seen_r.setdefault(rid, b)
        for p in [prompt_of(rid) for rid in dict.fromkeys(rollouts)]:
            if p in seen_p:
                c.problems.append(f"prompt {p} trained in batches {seen_p[p]} and {b}")
            seen_p.setdefault(p, b)
    c.what = f"{len(seen_r)} rollouts of {len(seen_p)} prompts in {len(batches)} batches, once each"
    return c

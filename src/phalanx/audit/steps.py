"""The policy's steps, from the replicas' ``step`` lines and the journal.

A committed step is printed by the replicas that committed it (FT: every
participant; RL: the policy's leader), each line naming its ``quorum_id``. Quorum
ids only grow, so they order the job's commits across processes without clocks.
A step number committed again in a later quorum is legitimate only after an
explicit rollback (journaled: ``quorum_id``, ``from_step``, ``to_step``) to a step
below it; anything else is a step committed twice. A restarted replica is a new
incarnation (a new replica id): its steps start wherever it resumed or healed.
"""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path
from typing import Any

from phalanx.audit.base import Check, Rollback, Run

CONTENT_KEYS = ("loss", "participants", "cursor", "batch", "rollouts", "state_hash")
"""Fields that every line of one committed step must agree on (those present):
``state_hash`` (``train.log_state_hash``) is the digest of the state the replica
committed, so replicas of one step hold one state."""


def rolled_back_between(rbs: list[Rollback], q1: int, q2: int, step: int) -> bool:
    """A rollback after quorum ``q1``, no later than quorum ``q2``, to below ``step``:
    ``step`` committed in ``q1`` may be committed again in ``q2``."""
    return any(q1 < rb.quorum_id <= q2 and rb.to_step < step for rb in rbs)


def _key(e: dict[str, Any]) -> tuple[int, int]:
    return int(e.get("quorum_id", 0)), int(e["step"])


def check_once(run: Run) -> Check:
    """Every step committed once: the lines of one step in one quorum agree on its
    contents, no more replicas printed it than took part, and it was committed in
    another quorum only after a rollback below it."""
    c = Check("steps.once", "")
    groups: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for e in run.steps():
        groups.setdefault(_key(e), []).append(e)
    quorums: dict[int, list[int]] = {}
    for (q, step), evs in sorted(groups.items()):
        quorums.setdefault(step, []).append(q)
        first = evs[0]
        for e in evs[1:]:
            diff = [k for k in CONTENT_KEYS if k in first and e.get(k) != first.get(k)]
            if diff:
                c.problems.append(
                    f"step {step} (quorum {q}) committed with different {', '.join(diff)} "
                    f"by {first['replica']} and {e['replica']}"
                )
        ids = [e["replica"] for e in evs]
        twice = sorted({i for i in ids if ids.count(i) > 1})
        if twice:
            c.problems.append(f"step {step} (quorum {q}) printed twice by {', '.join(twice)}")
        parts = int(first.get("participants", 1))
        if len(set(ids)) > parts:
            c.problems.append(
                f"step {step} (quorum {q}): {len(set(ids))} replicas printed it but "
                f"{parts} took part"
            )
    last: dict[str, int] = {}
    for e in run.steps():
        last[e["replica"]] = max(last.get(e["replica"], 0), int(e["step"]))
    discarded: list[str] = []
    for step, qs in sorted(quorums.items()):
        for q1, q2 in pairwise(qs):
            if rolled_back_between(run.rollbacks, q1, q2, step):
                continue
            cut = _discarded_branch(groups[(q1, step)], groups[(q2, step)], last, run.rl)
            if cut:
                discarded.append(f"step {step} by {', '.join(cut)} (quorum {q1})")
                continue
            c.problems.append(
                f"step {step} committed in quorum {q1} and again in quorum {q2} with no "
                f"rollback between"
            )
    again = sum(len(qs) - 1 for qs in quorums.values()) - len(discarded)
    c.what = f"{len(quorums)} steps, each committed once" + (
        f" ({again} again after a rollback)" if again else ""
    )
    if discarded:
        c.what += (
            f"; {len(discarded)} commit(s) on a cut-off branch, discarded (the replica "
            f"that made it alone ended there and came back healed): {'; '.join(discarded[:3])}"
        )
    if not quorums:
        c.problems.append("no replica log holds a committed step")
    return c


def _discarded_branch(
    first: list[dict[str, Any]], again: list[dict[str, Any]], last: dict[str, int], rl: bool
) -> list[str]:
    """The replicas of ``first`` (one step's lines in one quorum) when that commit was
    a branch the job discarded, else []. A replica cut off inside the step's collective
    (its sends lost, its peers' still arriving) can finish it on its side alone while
    its peers time out and commit the step again in a later quorum without it. Its
    commit is a discarded branch, not a second commit, when fewer replicas printed it
    than took part, none of them printed the later commit, and each of them (that
    incarnation) committed nothing after it: it was evicted there, and its name came
    back as a new incarnation that healed from the job.

    RL (``rl``): the policy's leader prints a step when it commits, before a save holds
    it, and the ledger counts a batch trained only once one does. A policy killed in
    between loses the step with its process; the restarted one resumes from the last
    save and trains the step again (the ledger's checks hold each rollout trained
    once). So there, a step whose printers all ended at it is a discarded branch even
    when every participant printed it."""
    ids = {e["replica"] for e in first}
    parts = int(first[0].get("participants", 1))
    step = int(first[0]["step"])
    if (len(ids) >= parts and not rl) or ids & {e["replica"] for e in again}:
        return []
    return sorted(ids) if all(last[i] == step for i in ids) else []


def check_order(run: Run) -> Check:
    """Steps never go backwards: in each incarnation's log, each step is above the one
    before, except across a journaled rollback below it."""
    c = Check("steps.order", "")
    last: dict[str, dict[str, Any]] = {}
    for e in run.steps():
        prev = last.get(e["replica"])
        last[e["replica"]] = e
        if prev is None or e["step"] > prev["step"]:
            continue
        (q1, s1), (q2, s2) = _key(prev), _key(e)
        if q2 < q1:
            c.problems.append(
                f"{e['replica']}: quorum {q2} after quorum {q1} (step {s1} -> {s2}) in {e['_log']}"
            )
        elif not rolled_back_between(run.rollbacks, q1, q2, s2):
            c.problems.append(
                f"{e['replica']} went back from step {s1} (quorum {q1}) to {s2} (quorum {q2}) "
                f"with no rollback in the journal"
            )
    n = len(run.rollbacks)
    c.what = f"never backwards in {len(last)} incarnation(s)" + (
        f"; {n} journaled rollback(s) followed" if n else ""
    )
    return c


def resumed_from(run: Run) -> int:
    """The checkpoint step every replica of the policy started from (``start`` lines'
    ``resumed_from``; 0: one started fresh): a job restarted whole from a checkpoint,
    under a new controller, holds only the steps after it in its logs."""
    starts = [
        e.get("resumed_from") or 0
        for evs in run.events.values()
        for e in evs
        if e.get("event") == "start" and e.get("role", "policy") == "policy"
    ]
    return min(starts, default=0)


def step_batch(run: Run) -> int | None:
    """Samples one committed step takes (its cursor's stride): the global batch, or a
    synchronous DiLoCo round's ``sync_every`` of them; None where no cursor says (RL,
    decoupled DiLoCo)."""
    cfg = run.config
    if run.rl:
        return None
    if cfg.diloco is None:
        return int(cfg.train.global_batch_size)
    if cfg.diloco.mode == "sync":
        return int(cfg.diloco.sync_every * cfg.train.global_batch_size)
    return None


def check_complete(run: Run) -> Check:
    """No committed step is missing: steps 1 (or the checkpoint every replica resumed
    from, plus one) to the journal's step, or the logs' last if later, each appear in
    some log, and none a step at or below that checkpoint. FT: each step's cursor is
    ``step x`` :func:`step_batch` (the global batch is constant)."""
    c = Check("steps.complete", "")
    steps = {int(e["step"]) for e in run.steps()}
    top = max(steps, default=0)
    # The controller learns a step from the next quorum or heartbeat, which the job's
    # last step (or a step just before a whole-job kill) may never have: the journal
    # may be behind the logs, never ahead of them.
    journaled = run.committed_step if run.committed_step is not None else top
    last = max(journaled, top)
    floor = resumed_from(run)
    missing = sorted(set(range(floor + 1, last + 1)) - steps)
    if missing:
        c.problems.append(
            f"step(s) {_ranges(missing)} committed (journal: {journaled}) but in no log"
        )
    if floor and min(steps, default=floor + 1) <= floor:
        c.problems.append(
            f"a log holds step {min(steps)}, at or below the checkpoint (step {floor}) every "
            f"replica resumed from"
        )
    batch = step_batch(run)
    if batch is not None:
        bad = [e for e in run.steps() if "cursor" in e and e["cursor"] != e["step"] * batch]
        for e in bad[:3]:
            c.problems.append(
                f"step {e['step']} by {e['replica']}: cursor {e['cursor']}, expected "
                f"{e['step'] * batch} (step x {batch} samples a step)"
            )
    c.what = (
        f"steps {floor + 1}..{last} all in the logs"
        + (f" (the journal's step: {journaled})" if run.committed_step is not None else "")
        + (f"; resumed from the checkpoint of step {floor}" if floor else "")
    )
    return c


def check_finals(run: Run) -> Check:
    """The final files of one job are byte-identical and at the job's last step
    (DESIGN.md: every replica of a role ends on the job's last committed step)."""
    c = Check("final.same", "")
    if not run.finals:
        c.skipped = "no final state in final/"
        return c
    blobs = {p.read_bytes() for p in run.finals}
    if len(blobs) > 1:
        c.problems.append(
            f"{len(blobs)} different final files among {len(run.finals)}: "
            f"{', '.join(p.name for p in run.finals)}"
        )
    last = run.committed_step if run.committed_step is not None else None
    for p in run.finals:
        step = header_meta(p).get("step")
        if last is not None and step is not None and int(step) != last:
            c.problems.append(f"{p.name} is at step {step}, the job's last is {last}")
    c.what = f"{len(run.finals)} final file(s), byte-identical" + (
        f", at step {last}" if last is not None else ""
    )
    return c


def header_meta(path: Path) -> dict[str, str]:
    """A safetensors file's ``__metadata__``, read from its header (no tensor loaded)."""
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(n))
    return dict(head.get("__metadata__") or {})


def _ranges(xs: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``1-3, 7`` (the first few runs)."""
    runs: list[tuple[int, int]] = []
    for x in xs:
        if runs and x == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], x)
        else:
            runs.append((x, x))
    text = ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs[:5])
    return text + (", ..." if len(runs) > 5 else "")

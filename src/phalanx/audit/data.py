"""Exactly-once data of an FT job, from its logs alone: each committed step's global
batch is the sampler's for that step.

The sampler's stream depends only on the dataset's size and the job's seed
(:mod:`phalanx.data.sampler`), and step ``s`` takes stream positions
``[(s - 1) B, s B)`` (``B`` the constant global batch). With ``train.log_samples``
each participant's ``step`` line holds its share (``samples``) and the sampler's
``dataset_size``; the shares, in rank order (the quorum sorts members by replica
id), must concatenate to exactly those positions' sample indices: no sample
dropped, repeated or taken out of turn, whoever failed. So a chaos run is checked
against the sampler, with no calm run needed (``--against`` compares with one).

A synchronous DiLoCo job's step is an outer round of ``H`` (``sync_every``) global
batches: its shares, taken together, must be the round's ``H B`` positions.

A participant SIGKILLed between its commit and its line leaves that step short of a
share: the shares printed must then be distinct parts of the step's batch, and such
steps can number at most the incarnations that ended without their ``done`` line
(each dies once).
"""

from __future__ import annotations

from typing import Any

from phalanx.audit.base import Check, Run
from phalanx.audit.steps import step_batch


def _applies(run: Run) -> str | None:
    if run.rl:
        return "an RL job: its data is the ledger's (ledger.*)"
    if step_batch(run) is None:
        return "a decoupled DiLoCo job: its replicas read their own shards, with no global cursor"
    return None


def _latest(run: Run) -> dict[int, dict[str, dict[str, Any]]]:
    """Each step's lines with sample ids, by replica id, from the step's last quorum
    (a step committed again after a rollback counts as the later commit)."""
    by_key: dict[tuple[int, int], dict[str, dict[str, Any]]] = {}
    for e in run.steps():
        if "samples" in e and "dataset_size" in e:
            by_key.setdefault((int(e["step"]), int(e.get("quorum_id", 0))), {})[e["replica"]] = e
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for (step, _q), lines in sorted(by_key.items()):
        out[step] = lines
    return out


def _died(run: Run) -> int:
    """Incarnations that printed a step and no ``done`` line: those that died."""
    stepped = {e["replica"] for e in run.steps()}
    done = {
        e.get("replica") for evs in run.events.values() for e in evs if e.get("event") == "done"
    }
    return len(stepped - done)


def check_samples(run: Run) -> Check:
    """Each committed step's global batch is the sampler's (module docstring)."""
    from phalanx.data.sampler import ElasticSampler

    c = Check("data.samples", "")
    why = _applies(run)
    if why is not None:
        c.skipped = why
        return c
    steps = _latest(run)
    if not steps:
        c.skipped = "no sample ids with the dataset's size in the logs (train.log_samples)"
        return c
    batch = step_batch(run)
    assert batch is not None  # (_applies)
    # A DiLoCo round's shares interleave its inner steps: compared as multisets.
    rounds = run.config.diloco is not None
    sizes = {int(e["dataset_size"]) for lines in steps.values() for e in lines.values()}
    if len(sizes) > 1:
        c.problems.append(f"the replicas' samplers disagree on the dataset's size: {sorted(sizes)}")
        return c
    size = sizes.pop()
    sampler = ElasticSampler(size, seed=run.config.job.seed)
    repeats = _repeats_in_an_epoch(sampler, max(steps) * batch)
    if repeats:
        c.problems.append(repeats)
    short = 0
    for step, lines in sorted(steps.items()):
        want = sampler.positions((step - 1) * batch, batch)
        got = [i for rid in sorted(lines) for i in lines[rid]["samples"]]
        if rounds:
            got, want = sorted(got), sorted(want)
        parts = int(next(iter(lines.values())).get("participants", 1))
        if len(lines) >= parts:
            if got != want:
                c.problems.append(f"step {step}: global batch is not the sampler's for the step")
            continue
        short += 1
        if not _parts_of(got, want):
            c.problems.append(
                f"step {step}: its printed shares are not distinct parts of its batch"
            )
    died = _died(run)
    if short > died:
        c.problems.append(
            f"{short} step(s) lack a participant's share, more than the {died} incarnation(s) "
            f"that died"
        )
    c.what = f"{len(steps) - short} global batches are the sampler's" + (
        f"; {short} short of a killed replica's share, the rest of it the sampler's"
        if short
        else ""
    )
    return c


def _repeats_in_an_epoch(sampler: Any, n: int) -> str | None:
    """The sampler's first ``n`` positions take each sample once per epoch (what makes
    "the sampler's batches" mean exactly-once data)."""
    stream = sampler.positions(0, n)
    size = sampler.num_samples
    for start in range(0, len(stream), size):
        epoch = stream[start : start + size]
        if len(set(epoch)) != len(epoch):
            return f"the sampler repeats a sample within epoch {start // size}"
    return None


def _parts_of(got: list[int], want: list[int]) -> bool:
    """``got`` takes each index of ``want`` at most as often as ``want`` holds it (a batch
    that straddles an epoch boundary may hold an index twice)."""
    left: dict[int, int] = {}
    for i in want:
        left[i] = left.get(i, 0) + 1
    for i in got:
        if left.get(i, 0) == 0:
            return False
        left[i] -= 1
    return True

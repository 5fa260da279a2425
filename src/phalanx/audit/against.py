"""A run against a calm run of the same job (``--against CALM_RUN_DIR``).

The committed global batches of a run depend only on committed steps (DESIGN.md,
Main flows), so a run with failures must commit the calm run's batches, step for
step. Its final state is then the calm run's up to the reduction's rounding
(docs/architecture.md, "Same global batches, same numbers?"):

- bit-identical with exact reduction (``train.exact_reduction``; an RL policy's
  ``rl.grpo.exact_reduction`` in lockstep, ``rl.loop.max_staleness = 0``), or when
  every step of both runs had the same participants;
- otherwise within :data:`ATOL` of the calm run, by the training dtype: the largest
  absolute difference of any tensor;
- an RL job with float reduction: not compared, since the rounding changes later
  samples and so the batches themselves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from phalanx.audit.base import Check, Run
from phalanx.audit.ledger import lineage_batches, prompt_of

ATOL = {"float64": 1e-9, "float32": 1e-4}
"""Largest absolute difference allowed between a run's final tensors and a calm
run's, with float reduction and a membership that changed (float64: what
``tests/integration/test_ft_ddp.py`` shows; float32: measured on
``examples/ft_mlp.toml``, docs/operations.md "Auditing a run")."""
OTHER_ATOL = 1e-2
"""The same for float16/bfloat16 training."""


def exact(run: Run) -> bool:
    """Whether the job's numbers do not depend on who took part in a step."""
    cfg = run.config
    if cfg.rl is not None:
        return bool(cfg.rl.grpo.exact_reduction and cfg.rl.loop.max_staleness == 0)
    return bool(cfg.train.exact_reduction)


def _same_job(run: Run, calm: Run) -> str | None:
    a, b = run.config, calm.config
    if a.job.id != b.job.id or (a.rl is None) != (b.rl is None):
        return f"the calm run is another job ({b.job.id}, not {a.job.id})"
    return None


def global_batches(run: Run) -> tuple[dict[int, list[int]], int]:
    """FT: each committed step's global batch (the shares of the replicas that printed
    it, in rank order: the quorum sorts members by replica id), for the steps every
    participant printed; and how many steps lacked a share (a replica killed
    between its commit and its line)."""
    by_step: dict[tuple[int, int], dict[str, list[int]]] = {}
    parts: dict[tuple[int, int], int] = {}
    for e in run.steps():
        if "samples" not in e:
            continue
        k = (int(e["step"]), int(e.get("quorum_id", 0)))
        by_step.setdefault(k, {})[e["replica"]] = list(e["samples"])
        parts[k] = int(e.get("participants", 1))
    out: dict[int, list[int]] = {}
    partial = 0
    for (step, _q), shares in sorted(by_step.items()):  # a later quorum's wins (rollback)
        if len(shares) < parts[(step, _q)]:
            partial += 1
            continue
        out[step] = [i for rid in sorted(shares) for i in shares[rid]]
    return out, partial


def check_batches(run: Run, calm: Run) -> Check:
    """The committed global batches (sample ids) equal the calm run's, step for step."""
    c = Check("against.batches", "")
    other = _same_job(run, calm)
    if other:
        c.problems.append(other)
        return c
    if run.rl:
        return _rl_batches(run, calm, c)
    got, partial = global_batches(run)
    want, _ = global_batches(calm)
    if not got or not want:
        # No sample ids (train.log_samples off): the cursors, which the batches follow.
        cur = {int(e["step"]): e.get("cursor") for e in run.steps()}
        ref = {int(e["step"]): e.get("cursor") for e in calm.steps()}
        diff = sorted(s for s in cur.keys() & ref.keys() if cur[s] != ref[s])
        c.problems += [f"step {s}: cursor {cur[s]}, calm run {ref[s]}" for s in diff]
        if set(cur) != set(ref):
            c.problems.append(f"steps 1..{max(cur, default=0)}, calm run 1..{max(ref, default=0)}")
        c.what = f"{len(cur)} steps, same cursors (no sample ids in the logs: train.log_samples)"
        return c
    if set(got) - set(want):
        c.problems.append(f"steps the calm run never committed: {sorted(set(got) - set(want))[:5]}")
    for step in sorted(got.keys() & want.keys()):
        if got[step] != want[step]:
            c.problems.append(f"step {step}: global batch differs from the calm run's")
    c.what = f"{len(got.keys() & want.keys())} global batches equal the calm run's" + (
        f" ({partial} step(s) with a share missing from the logs, not compared)" if partial else ""
    )
    return c


def _rl_batches(run: Run, calm: Run, c: Check) -> Check:
    if not exact(run):
        c.skipped = (
            "RL with float reduction: the rounding changes later samples, so the batches "
            "differ by design (rl.grpo.exact_reduction and max_staleness 0 make them equal)"
        )
        return c
    got, want = lineage_batches(run), lineage_batches(calm)
    for b in sorted(got.keys() | want.keys()):
        gp = sorted(prompt_of(r) for r in got.get(b, []))
        wp = sorted(prompt_of(r) for r in want.get(b, []))
        if gp != wp:
            c.problems.append(f"batch {b}: prompts {gp[:4]}..., calm run {wp[:4]}...")
    c.what = f"{len(got)} batches train the calm run's prompts"
    return c


def check_final(run: Run, calm: Run) -> Check:
    """The final state against the calm run's: bit-identical, or within the tolerance
    of the module docstring."""
    c = Check("against.final", "")
    other = _same_job(run, calm)
    if other:
        c.problems.append(other)
        return c
    if not run.finals or not calm.finals:
        c.problems.append(f"no final state in {(run if not run.finals else calm).path}/final")
        return c
    if run.rl and not exact(run):
        c.skipped = (
            "RL with float reduction: the rounding changes later samples (not comparable; "
            "rl.grpo.exact_reduction and max_staleness 0 make it bit-identical)"
        )
        return c
    bits = exact(run) or _same_split(_participants(run), _participants(calm))
    got, want = _load(run.finals[0]), _load(calm.finals[0])
    keys = sorted(k for k in got[1].keys() | want[1].keys() if got[1].get(k) != want[1].get(k))
    if keys:
        shown = ", ".join(
            f"{k} {got[1].get(k, '-')[:40]} (calm {want[1].get(k, '-')[:40]})" for k in keys
        )
        c.problems.append(f"metadata differs: {shown}")
    if got[0].keys() != want[0].keys():
        c.problems.append(f"tensors differ in name: {sorted(got[0].keys() ^ want[0].keys())[:4]}")
        return c
    dtype = run.config.train.dtype if not run.rl else "float32"
    atol = 0.0 if bits else ATOL.get(dtype, OTHER_ATOL)
    worst = 0.0
    for k in sorted(want[0]):
        a, b = got[0][k], want[0][k]
        if a.dtype != b.dtype or a.shape != b.shape:
            c.problems.append(
                f"{k}: {a.dtype} {tuple(a.shape)}, calm run {b.dtype} {tuple(b.shape)}"
            )
            continue
        d = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
        worst = max(worst, d)
        if d > atol:
            c.problems.append(f"{k} differs by {d:.3g} > {atol:g}")
    why = "exact reduction" if exact(run) else "same participants and split every step"
    c.what = (
        f"bit-identical to the calm run's ({why})"
        if bits
        else f"within {atol:g} of the calm run's ({dtype}, float reduction): largest "
        f"difference {worst:.3g}"
    )
    return c


def _same_split(got: dict[int, Any], want: dict[int, Any]) -> bool:
    """Whether every step had as many participants as the calm run's, and each replica
    that printed the step in both runs held a share of the same size. A replica killed
    before it printed its line leaves no size: the others' sizes and the count fix the
    split all the same."""
    if got.keys() != want.keys():
        return False
    for step, (n, sizes) in got.items():
        m, calm_sizes = want[step]
        if n != m or any(sizes[r] != calm_sizes[r] for r in sizes.keys() & calm_sizes.keys()):
            return False
    return True


def _participants(run: Run) -> dict[int, Any]:
    """Each step's participants and how the global batch was split among them (the
    sizes of their shares by replica name: a straggler's smaller share changes which
    replica sums which samples, and so the float rounding)."""
    out: dict[int, Any] = {}
    for e in run.steps():
        sizes = out.setdefault(int(e["step"]), [int(e.get("participants", 1)), {}])[1]
        if "samples" in e:
            sizes[str(e["replica"]).split(":")[0]] = len(e["samples"])
    return out


def _load(path: Path) -> tuple[dict[str, Any], dict[str, str]]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})  # noqa: SIM118

"""What ``phalanx run`` shows: a live rich table on a terminal (plain lines
otherwise) while the job runs, and one summary line at the end (plus a JSON
summary with ``--json``, for benchmarks to parse).

Per-replica rows come from the replicas' own JSON lines; job-wide numbers of an
RL job (step, batch, reward, exact match, the prompt and rollout ledger) come
from the controller's status, which is the source of truth for them.
"""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Any

from phalanx.console.summary import (
    discard_text,
    ft_line,
    ft_summary,
    latest_val,
    num,
    perf_text,
    rl_line,
    rl_summary,
)

if TYPE_CHECKING:
    from phalanx.launch.local import LocalJob
    from phalanx.protocol.status import Status


class View:
    """Live progress: a rich table on a terminal, plain lines otherwise."""

    def __init__(self, job: LocalJob, live: bool):
        self.job = job
        self.live_enabled = live and sys.stdout.isatty()
        self._live: Any = None
        self._printed_step = 0
        self._printed_events = 0
        self._printed_at: float | None = None
        self._printed_batch_at = 0.0

    def __enter__(self) -> View:
        if self.live_enabled:
            from rich.live import Live

            self._live = Live(self._render(), refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self._render())
            self._live.__exit__(*exc)
        else:
            with self.job.lock:
                self._print_events()

    # -- live table ------------------------------------------------------

    def _render(self) -> Any:
        from rich.console import Group
        from rich.text import Text

        with self.job.lock:
            table = self._rl_table() if self.job.rl else self._ft_table()
            lines = [*self._rl_lines()] if self.job.rl else []
            notes = self.job.events
            if self.job.dashboard:
                # Always in sight, not scrolled away with the notes.
                link = f"dashboard: {self.job.dashboard}"
                lines.append(link)
                notes = [e for e in notes if not e.endswith(link)]
            events = "\n".join(notes[-6:])
        # Text, not str: a replica's error text in the notes must not be read as markup.
        return Group(table, *(Text(x) for x in lines), Text(events))

    def _ft_table(self) -> Any:
        from rich.table import Table

        job = self.job
        steps = job.cfg.job_steps
        t = Table(
            title=f"phalanx run: job {job.cfg.job.id}  ({time.monotonic() - job.started:.0f} s)"
        )
        for col in ("replica", "pid", "step", "loss", "participants", "quorum", "starts", "heals"):
            t.add_column(col)
        for r in job.replicas.values():
            t.add_row(
                r.name,
                r.state(),
                f"{r.step}/{steps}",
                num(r.loss, ".5f"),
                str(r.participants),
                str(r.quorum_id),
                str(r.starts),
                str(r.heals),
            )
        return t

    def _rl_table(self) -> Any:
        from rich import box
        from rich.table import Table

        job = self.job
        st = job.status()
        rl = st.rl if st is not None else None
        last = rl.last if rl is not None else None
        title = (
            f"phalanx run: job {job.cfg.job.id}  ({time.monotonic() - job.started:.0f} s)  "
            f"step {rl.policy_step if rl else 0}  batch {last.batch if last else '-'}  "
            f"weights v{rl.weights.synced_version if rl else 0}"
        )
        # Narrow enough for an 80-column terminal.
        t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, title_justify="left")
        for col in ("replica", "pid", "ver", "reward", "exact", "stale", "progress"):
            t.add_column(col, no_wrap=True)
        t.add_column("syncs", justify="right", no_wrap=True)
        for r in sorted(job.replicas.values(), key=lambda r: (r.role, r.index)):
            if r.role == "policy":
                progress = f"step {r.step} loss {num(r.loss)}"
                progress += f" x{r.participants}" if r.participants > 1 else ""
                progress += f" healed {r.heals}" if r.heals else ""
                stale = "-" if r.staleness is None else str(r.staleness)
            else:
                progress = f"{r.rollouts} rollouts"
                progress += f" ({r.duplicates} dup)" if r.duplicates else ""
                stale = str(r.stale)
            t.add_row(
                r.name,
                r.state(),
                "-" if r.version is None else f"v{r.version}",
                num(r.reward),
                num(r.exact_match),
                stale,
                progress,
                str(r.syncs),
            )
        return t

    def _rl_lines(self) -> list[str]:
        job = self.job
        st = job.status()
        rl = st.rl if st is not None else None
        last = rl.last if rl is not None else None
        loop = job.cfg.rl.loop if job.cfg.rl else None
        target = loop.target_exact_match if loop else None
        target_r = loop.target_reward if loop else None
        r_target = f", target {target_r}" if target_r is not None else ""
        lines = [
            f"reward {num(last.reward if last else None)} (avg {num(last.reward_avg if last else None)}{r_target})  "
            f"exact {num(last.exact_match if last else None)} (avg {num(last.exact_match_avg if last else None)}, "
            f"target {target if target is not None else 'none'})  "
            f"staleness {last.staleness if last else '-'}"
        ]
        if rl is not None:
            p, ro, le = rl.prompts, rl.rollouts, rl.leases
            lines.append(
                f"prompts: issued {p.issued} = queued {p.queued} + leased {p.leased} "
                f"+ done {p.done} + trained {p.trained}"
                + (f" + dropped {p.dropped}" if p.dropped else "")
            )
            lines.append(
                f"rollouts: trained {ro.trained}, pending {ro.pending}, batched "
                f"{ro.batched}, discarded {discard_text(ro.discarded)}, duplicates "
                f"{ro.duplicates_dropped}"
                + (f", refused unleased {ro.unleased_refused}" if ro.unleased_refused else "")
                + f"; leases open {le.open}, expired {le.expired}"
                + ("" if rl.ok else "; LEDGER UNBALANCED")
            )
        roles = st.roles if st is not None else {}
        parts = []
        for role in job.cfg.roles:
            n = sum(1 for r in job.replicas.values() if r.role == role and r.running)
            info = roles.get(role)
            desired = info.desired if info is not None else None
            members = len(info.replicas) if info is not None else 0
            parts.append(
                f"{role} {n} running, {members} registered"
                + (f", desired {desired}" if desired is not None else "")
            )
        lines.append("replicas: " + "; ".join(parts))
        return lines

    # -- plain lines -----------------------------------------------------

    def _print_events(self) -> None:
        job = self.job
        for line in job.events[self._printed_events :]:
            print(line, flush=True)
        self._printed_events = len(job.events)

    def update(self) -> None:
        if self._live is not None:
            self._live.update(self._render())
            return
        job = self.job
        with job.lock:
            self._print_events()
            if job.rl:
                self._rl_progress()
            elif job.replicas:
                self._ft_progress()

    def _ft_progress(self) -> None:
        job = self.job
        lead = max(job.replicas.values(), key=lambda r: r.step)
        if lead.step >= self._printed_step + 25 or (
            lead.step == job.cfg.job_steps and lead.step > self._printed_step
        ):
            self._printed_step = lead.step
            print(
                f"{time.monotonic() - job.started:7.1f}s  step {lead.step:5d}  loss {num(lead.loss, '.5f')}  "
                f"participants {lead.participants}  quorum {lead.quorum_id}"
                f"{perf_text(lead, latest_val(list(job.replicas.values())))}",
                flush=True,
            )

    def _rl_progress(self) -> None:
        """One line per trained batch, at most one a second (always the newest)."""
        job = self.job
        st = job.status()
        rl = st.rl if st is not None else None
        last = rl.last if rl is not None else None
        now = time.monotonic()
        if rl is None or last is None or last.at == self._printed_at:
            return
        if now - self._printed_batch_at < 1.0 and not rl.finished:
            return
        self._printed_at, self._printed_batch_at = last.at, now
        ro = rl.rollouts
        print(
            f"{now - job.started:7.1f}s  batch {last.batch:4d}  step {last.step:5d}  "
            f"reward {last.reward:.3f} (avg {last.reward_avg:.3f})  exact "
            f"{last.exact_match:.3f} (avg {last.exact_match_avg:.3f})  staleness "
            f"{last.staleness}  v{rl.weights.synced_version}{_tokens(last)}  |  prompts "
            f"{rl.prompts.issued}, rollouts trained {ro.trained}, discarded "
            f"{sum(ro.discarded.values())}",
            flush=True,
        )

    # -- summary ---------------------------------------------------------

    def summary(self, as_json: bool = False) -> dict[str, Any]:
        job = self.job
        s = rl_summary(job) if job.rl else ft_summary(job)
        print("\n" + (rl_line(job, s) if job.rl else ft_line(job, s)), flush=True)
        (job.run_dir / "summary.json").write_text(json.dumps(s, indent=2) + "\n")
        if as_json:
            print(json.dumps(s), flush=True)
        return s


def status_text(st: Status) -> str:
    """``phalanx status`` without ``--json``: a few lines a person can read at a glance."""
    lines = [f"job {st.job_id} (controller epoch {st.epoch})"]
    j = st.journal
    if j is not None and not j.healthy:
        since = f" since {time.strftime('%H:%M:%S', time.localtime(j.unavailable_since))}"
        lines.append(
            f"  JOURNAL UNAVAILABLE{since if j.unavailable_since else ''}: {j.where}: {j.error}; "
            f"{j.unjournaled} change(s) held, requests that need a write get 503"
        )
    elif j is not None and j.kind == "etcd":
        lines.append(f"  journal: {j.where} (leader term {j.term})")
    c = st.controllers
    if c is not None:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.since))
        standbys = ", ".join(s.url for s in c.standbys) or "none"
        lines.append(
            f"  controller: {c.leader} leads since {since} (term {c.term}, "
            f"{c.failovers} failover(s)); standbys: {standbys}"
        )
    for role, info in st.roles.items():
        reps = info.replicas
        suspects = sum(1 for r in reps if r.suspect)
        desired = info.desired
        ov = st.overview.roles.get(role)
        quorate = ov.forms_quorums if ov is not None else True
        lines.append(
            f"  {role}: {len(reps)} replica(s)"
            + (f" (desired {desired})" if desired is not None else "")
            + (f", {suspects} suspect" if suspects else "")
            + (f", step {info.step}, quorum {info.quorum_id}" if quorate else "")
        )
    for role, info in st.roles.items():
        for rb in info.rollbacks[-3:]:
            lines.append(
                f"  {role} ROLLED BACK from step {rb.from_step} to step {rb.to_step}"
                + (
                    f": {rb.batches} batches, {rb.prompts} prompts issued again"
                    if rb.batches is not None
                    else ""
                )
                + " (no replica and no checkpoint held it)"
            )
    ck = st.checkpoints.latest
    if ck is not None:
        lines.append(
            f"  checkpoint: step {ck.step} at {ck.url} ({ck.nbytes / 1e6:.1f} MB, by {ck.by})"
        )
    rl = st.rl
    if rl is not None:
        p, ro = rl.prompts, rl.rollouts
        lines.append(
            f"  rl: {'finished' if rl.finished else 'running'}, policy step "
            f"{rl.policy_step}, next batch {rl.next_batch}, weights "
            f"v{rl.weights.synced_version}"
        )
        lines.append(
            f"  prompts: issued {p.issued} = queued {p.queued} + leased {p.leased} + "
            f"done {p.done} + trained {p.trained}"
            + (f" + dropped {p.dropped}" if p.dropped else "")
        )
        lines.append(
            f"  rollouts: accepted {ro.accepted} = pending {ro.pending} + batched "
            f"{ro.batched} + trained {ro.trained} + discarded "
            f"{sum(ro.discarded.values())} ({discard_text(ro.discarded)}); duplicates "
            f"dropped {ro.duplicates_dropped}; ledger " + ("balanced" if rl.ok else "UNBALANCED")
        )
        last = rl.last
        if last is not None:
            lines.append(
                f"  last batch {last.batch}: reward {last.reward:.3f} (avg "
                f"{last.reward_avg:.3f}), exact match {last.exact_match:.3f} (avg "
                f"{last.exact_match_avg:.3f}), staleness {last.staleness}"
            )
    return "\n".join(lines)


def _tokens(rec: Any) -> str:
    """`` 412 tok/s (train 1.9k)`` from a history record, or '' before there is one."""
    parts = []
    if rec.tokens_per_s is not None:
        parts.append(f"  {_si(rec.tokens_per_s)} tok/s")
    train = rec.metrics.train_tokens_per_s if rec.metrics is not None else None
    if train is not None:
        parts.append(f" (train {_si(train)})" if parts else f"  train {_si(train)} tok/s")
    return "".join(parts)


def _si(x: float) -> str:
    return f"{x / 1e6:.1f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e4 else f"{x:.0f}"

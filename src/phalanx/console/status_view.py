"""``phalanx status``: the job's status as rich tables (once, or live with ``--watch``).

The figures are those of the dashboard: the ``overview`` object of ``GET
/v1/status`` (see docs/operations.md for its fields), rendered for a terminal.
"""

from __future__ import annotations

import time
from typing import Any

from phalanx.console.view import status_text
from phalanx.protocol.status import Status


def _f(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    return f"{s:.1f}s" if s < 90 else f"{s / 60:.1f}m" if s < 5400 else f"{s / 3600:.1f}h"


STATE_STYLE = {
    "active": "green",
    "joining": "blue",
    "healing": "magenta",
    "suspected": "yellow",
    "evicted": "red",
}


def status_tables(st: Status, events: int = 8) -> Any:
    """A rich renderable: the summary lines, one table per role, the ledger, the timeline.
    Every cell is a :class:`~rich.text.Text`, so that nothing from the wire (a name, an
    address) is read as rich markup."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    ov = st.overview
    parts: list[Any] = [Text(status_text(st))]
    job = ov.job
    line = f"step {job.step}  quorum {job.quorum_id}  {_f(job.steps_per_s, '.2f')} steps/s"
    if job.rl is not None:
        rl = job.rl
        staleness = "-" if rl.staleness is None else rl.staleness
        line += f"  reward {_f(rl.reward)}  exact match {_f(rl.exact_match)}  staleness {staleness}"
    if job.diloco is not None:
        line += f"  DiLoCo outer {job.diloco.outer_step} inner {job.diloco.inner_step}"
    parts.append(Text(line, style="bold"))
    for role, r in ov.roles.items():
        t = Table(title=Text(role), title_justify="left", pad_edge=False)
        for col in (
            "replica",
            "state",
            "incarnation",
            "uptime",
            "weights",
            "heartbeat",
            "address",
            "step",
        ):
            t.add_column(col, no_wrap=True)
        for x in r.replicas:
            t.add_row(
                Text(x.name),
                Text(x.state, style=STATE_STYLE.get(x.state, "")),
                Text(x.incarnation),
                Text(_age(x.uptime_s)),
                Text("-" if x.weights_version is None else f"v{x.weights_version}"),
                Text(_age(x.heartbeat_age_s)),
                Text(x.address or "-"),
                Text(str(x.step) if r.forms_quorums else "-"),
            )
        for e in r.evicted[-3:]:
            name, _, inc = e.replica_id.rpartition(":")
            empty = Text("")
            t.add_row(
                Text(name), Text("evicted", style="red"), Text(inc), empty, empty, empty,
                Text(f"by {e.detector}"), empty,
            )  # fmt: skip
        parts.append(t)
    led = ov.ledger
    if led is not None:
        t = Table(title="ledger", title_justify="left", pad_edge=False)
        keys = ("prompts_leased", "prompts_done", "rollouts_pending", "rollouts_trained")
        for k in keys:
            t.add_column(k.replace("_", " "))
        t.add_column("discarded")
        disc = led.rollouts_discarded
        t.add_row(
            *(Text(str(getattr(led, k))) for k in keys),
            Text(", ".join(f"{k}: {v}" for k, v in disc.items()) or "none"),
        )
        parts.append(t)
    tl = ov.timeline[-events:]
    if tl:
        text = "\n".join(
            f"{time.strftime('%H:%M:%S', time.localtime(e.at))}  {getattr(e, 'text', e.kind)}"
            for e in tl
        )
        parts.append(Text(text))
    return Group(*parts)


def watch(fetch: Any, interval_s: float = 1.0) -> None:
    """Redraw the tables every ``interval_s`` until interrupted (Ctrl-C)."""
    from rich.live import Live
    from rich.text import Text

    with Live(Text("connecting..."), refresh_per_second=4, screen=False) as live:
        try:
            while True:
                try:
                    live.update(status_tables(fetch()))
                except Exception as e:  # keep watching through a controller restart
                    live.update(Text(f"controller unreachable: {e}", style="red"))
                time.sleep(interval_s)
        except KeyboardInterrupt:
            pass

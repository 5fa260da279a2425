"""``phalanx status``: the job's status as rich tables (once, or live with ``--watch``).

The figures are those of the dashboard: the ``overview`` object of ``GET
/v1/status`` (see docs/operations.md for its fields), rendered for a terminal.
"""

from __future__ import annotations

import time
from typing import Any

from phalanx.launch.view import status_text


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


def status_tables(st: dict[str, Any], events: int = 8) -> Any:
    """A rich renderable: the summary lines, one table per role, the ledger, the timeline."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    ov = st.get("overview") or {}
    parts: list[Any] = [Text(status_text(st))]
    job = ov.get("job") or {}
    line = f"step {job.get('step', 0)}  quorum {job.get('quorum_id', 0)}  {_f(job.get('steps_per_s'), '.2f')} steps/s"
    if job.get("rl"):
        rl = job["rl"]
        line += (
            f"  reward {_f(rl.get('reward'))}  exact match {_f(rl.get('exact_match'))}"
            f"  staleness {rl.get('staleness', '-')}"
        )
    if job.get("diloco"):
        d = job["diloco"]
        line += f"  DiLoCo outer {d['outer_step']} inner {d['inner_step']}"
    parts.append(Text(line, style="bold"))
    for role, r in (ov.get("roles") or {}).items():
        quorate = r["forms_quorums"]
        t = Table(title=f"{role}", title_justify="left", pad_edge=False)
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
        for x in r["replicas"]:
            state = x["state"]
            t.add_row(
                x["name"],
                Text(state, style=STATE_STYLE.get(state, "")),
                x["incarnation"],
                _age(x["uptime_s"]),
                "-" if x["weights_version"] is None else f"v{x['weights_version']}",
                _age(x["heartbeat_age_s"]),
                x["address"] or "-",
                str(x["step"]) if quorate else "-",
            )
        for x in r["evicted"][-3:]:
            name, _, inc = x["replica_id"].rpartition(":")
            t.add_row(
                name, Text("evicted", style="red"), inc, "", "", "", f"by {x['detector']}", ""
            )
        parts.append(t)
    led = ov.get("ledger")
    if led:
        t = Table(title="ledger", title_justify="left", pad_edge=False)
        keys = ("prompts_leased", "prompts_done", "rollouts_pending", "rollouts_trained")
        for k in keys:
            t.add_column(k.replace("_", " "))
        t.add_column("discarded")
        disc = led["rollouts_discarded"]
        t.add_row(
            *(str(led[k]) for k in keys),
            ", ".join(f"{k}: {v}" for k, v in disc.items()) or "none",
        )
        parts.append(t)
    tl = (ov.get("timeline") or [])[-events:]
    if tl:
        parts.append(
            Text(
                "\n".join(
                    f"{time.strftime('%H:%M:%S', time.localtime(e['at']))}  {e['text']}" for e in tl
                )
            )
        )
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

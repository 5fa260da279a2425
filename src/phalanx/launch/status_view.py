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


EVENT_TEXT = {
    "evict": "{who} evicted by {detector}: {reason}",
    "controller_start": "controller started (epoch {epoch})",
    "join": "{who} joined {role}",
    "checkpoint_requested": "checkpoint asked for step {step}",
    "sync_failed": "weight sync {seq} failed",
    "scale": "scale {role} to {replicas}",
    "drain": "drain {who}",
    "rl_finished": "RL job finished",
}
"""Timeline events said in one line from their fields (as the dashboard says them)."""


class _Fields(dict[str, Any]):
    """An event's fields for :data:`EVENT_TEXT`; one it lacks reads as below."""

    MISSING: dict[str, Any] = {"detector": "?", "epoch": None, "step": None, "replicas": None}

    def __missing__(self, key: str) -> Any:
        return self.MISSING.get(key, "")


def describe(e: dict[str, Any]) -> str:
    """One timeline event in words (as the dashboard's timeline says it)."""
    who = e.get("replica_id") or e.get("role", "")
    k = e["kind"]
    if k in EVENT_TEXT:
        return EVENT_TEXT[k].format_map(_Fields(e, who=who))
    if k == "active":
        return f"{who} active {_f(e.get('join_s'), '.1f')} s after joining"
    if k == "quorum":
        parts = [f"{e['role']} quorum {e['quorum_id']} of {e['size']}"]
        if e.get("healing"):
            parts.append(f"healing {e['healing']}")
        parts += [
            f"recovered from {r['replica_id']} ({r['detector']}) in {r['seconds']:.2f} s"
            for r in e.get("recovered", [])
        ]
        return ", ".join(parts)
    if k == "checkpoint":
        return f"checkpoint of step {e['step']} at {e['url']} ({e['nbytes'] / 1e6:.1f} MB)"
    if k == "sync_done":
        if e.get("runs"):
            return (
                f"weight syncs {e['first_seq']}-{e['seq']} done ({e['runs']}, "
                f"v{e['first_version']} to v{e['version']})"
            )
        return f"weight sync {e.get('seq', '')} done (v{e.get('version', '?')})"
    return f"{k} {who}".strip()


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
                    f"{time.strftime('%H:%M:%S', time.localtime(e['at']))}  {describe(e)}"
                    for e in tl
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

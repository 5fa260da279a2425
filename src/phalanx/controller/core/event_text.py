"""Timeline events in one line of words, decided once on the controller: the
overview's timeline carries each event's ``text``, which the dashboard and
``phalanx status`` both show as is."""

from __future__ import annotations

from typing import Any


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


EVENT_TEXT = {
    "evict": "{who} evicted by {detector}: {reason}",
    "controller_start": "controller started (epoch {epoch})",
    "join": "{who} joined {role}",
    "healed": "{who} healed from {source} to step {step} in {seconds} s",
    "checkpoint_requested": "checkpoint asked for step {step}",
    "sync_failed": "weight sync {seq} failed",
    "sync_short": "first weight sync went ahead with {up} of {n_init} rollout replicas "
    "after {waited_s} s",
    "scale": "scale {role} to {replicas}",
    "drain": "drain {who}",
    "rl_finished": "RL job finished",
    "rl_final_step": "RL job's last step is {step} (batch {batch}): finished once a save holds it",
    "journal_record_dropped": "journal record {table}/{key} dropped at restart: {reason}",
    "replay_unavailable": "replay unreachable: batch {batch} frozen from fresh rollouts only",
    "replay_write_waits": "replay unreachable: trained rollouts wait to be written ({error})",
}
"""Timeline events said in one line from their fields."""


class _Fields(dict[str, Any]):
    """An event's fields for :data:`EVENT_TEXT`; one it lacks reads as below."""

    MISSING: dict[str, Any] = {"detector": "?", "epoch": None, "step": None, "replicas": None}

    def __missing__(self, key: str) -> Any:
        return self.MISSING.get(key, "")


def describe(e: dict[str, Any]) -> str:
    """One timeline event in words. It serves every status request, so an event
    without the fields its kind usually has reads as its kind and replica."""
    who = e.get("replica_id") or e.get("role", "")
    try:
        return _describe(e, e.get("kind", "event"), who)
    except (KeyError, TypeError, ValueError):
        return f"{e.get('kind', 'event')} {who}".strip()


def _describe(e: dict[str, Any], k: str, who: str) -> str:
    if k == "evict" and e.get("detector") == "left":  # its reason is "left[: why]"
        return f"{who} {e.get('reason') or 'left'}"
    if k in EVENT_TEXT:
        return EVENT_TEXT[k].format_map(_Fields(e, who=who))
    if k == "straggler":
        return _straggler(e, who)
    if k == "active":
        return f"{who} active {_f(e.get('join_s'))} s after joining"
    if k == "quorum":
        parts = [f"{e['role']} quorum {e['quorum_id']} of {e['size']}"]
        if e.get("healing"):
            parts.append(f"healing {e['healing']}")
        parts += [
            f"recovered from {r['replica_id']} ({r['detector']}) in {r['seconds']:.2f} s"
            for r in e.get("recovered", [])
        ]
        return ", ".join(parts)
    if k == "rollback":
        text = f"rolled back from step {e['from_step']} to step {e['to_step']}"
        if "batches" in e:
            text += f": {e['batches']} batches, {e['prompts']} prompts issued again"
        return text + (f" ({e['reason']})" if e.get("reason") else "")
    if k == "checkpoint":
        return f"checkpoint of step {e['step']} at {e['url']} ({e['nbytes'] / 1e6:.1f} MB)"
    if k == "sync_done":
        if e.get("runs"):
            return (
                f"weight syncs {e['first_seq']}-{e['seq']} done ({e['runs']}, "
                f"v{e['first_version']} to v{e['version']})"
            )
        if e.get("source_role") == "rollout":
            return (
                f"weight sync {e['seq']} done (v{e['version']} relayed by rollout "
                f"{e['source']} to {e['members'] - 1})"
            )
        return f"weight sync {e.get('seq', '')} done (v{e.get('version', '?')})"
    return f"{k} {who}".strip()


STRAGGLER_TEXT = {
    "flagged": "{who} flagged as a straggler ({ratio}x its peers' step time): its share "
    "goes to {share} of an equal one",
    "share": "{who}, a straggler, gets {share} of an equal share ({ratio}x its peers' step time)",
    "cleared": "{who} no longer a straggler ({ratio}x its peers' step time): an equal share again",
}
"""A ``straggler`` event by its ``action`` (:mod:`.stragglers`)."""


def _straggler(e: dict[str, Any], who: str) -> str:
    return STRAGGLER_TEXT[e["action"]].format_map(_Fields(e, who=who))

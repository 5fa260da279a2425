"""Multi-turn episodes in progress (:mod:`phalanx.protocol.episode`): the last
progress the holder of each leased prompt reported, carried by the prompt when it
is dispatched again.

A rollout replica that runs a prompt's samples as multi-turn episodes reports,
after each completed turn, every episode of the prompt so far
(``POST /v1/rl/episodes``). A report is kept only while its prompt attempt is in
the caller's live lease (:meth:`~.prompts.PromptBook.holds`), and it replaces the
one kept before. When the lease ends unsubmitted (its deadline passed, its holder
was evicted or left, a drain released it) the prompt goes back to the queue as it
always did, under the same attempt, and the next lease's ``PromptRef.resume``
carries the progress kept: the new holder replays the recorded turns and generates
only from there. The progress stays kept until the prompt's rollout is accepted
(:meth:`EpisodeBook.forget`: a holder that dies too is resumed from it again), the
job finishes, or the prompt is dispatched under another attempt (its rollout was
discarded: the next attempt starts afresh, never from a discarded attempt's turns).

**Where it lives.** A report runs to megabytes (every turn's tokens and log-probs)
and comes after every turn, so it goes to the controller's payload log
(:mod:`phalanx.controller.payloads`), written before the journal commit like a
rollout's payload, under a key of its own (``ep/<rollout id>/<n>``, ``n`` the
count of reports kept so far). The journal holds one small record per prompt with
progress (table ``episodes``: the rollout id, that key, its bytes, episodes and
turns), rewritten in place by each report: it grows with the prompts in flight,
never with the reports. The payload a report replaces is dropped once the new
record is journaled, and a segment of the log is deleted once nothing in it is
held. At a restart the journal decides, as for rollouts: a payload no record
refers to (its commit never happened) is dropped, and a record whose payload is
missing is forgotten (:meth:`EpisodeBook.reconcile`: that prompt starts afresh).
With an etcd journal the payload log is the leading controller's own: a standby
that takes over holds none of it, and the prompts in flight start afresh.

**Memory.** Progress is held only for prompts in flight (leased, or queued to be
leased again), as its JSON text (a few times smaller than the objects it would
parse to: reports come every turn, while a resume is parsed only at a dispatch
after a failure), and ``rl.loop.episode_bytes`` caps its total: a report that
would pass it is not kept (``over_cap`` in the reply) and the one kept before
stays.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from phalanx.controller.core.base import ChangeLog, PayloadOf, StateError
from phalanx.controller.core.codec import encode_bytes
from phalanx.controller.core.ledger.prompts import PromptBook
from phalanx.controller.core.ledger.submission import rollout_prompt
from phalanx.protocol.episode import EpisodeProgress

COUNTS = (
    "episode_reports",
    "episode_unleased",
    "episode_over_cap",
    "episodes_resumed",
    "episode_turns_carried",
)
"""The ledger's counts this book keeps (journaled with the ledger's meta)."""


def episode_key(rollout_id: str, n: int) -> str:
    """A report's key in the controller's payload log."""
    return f"ep/{rollout_id}/{n}"


def check_progress(k: int, p: EpisodeProgress, group_size: int) -> None:
    """Refuse a report the job cannot resume from (a 400 naming the field), before
    anything is kept: a sample outside the group, or one sample twice."""
    seen: set[int] = set()
    for j, e in enumerate(p.episodes):
        if e.sample >= group_size or e.sample in seen:
            why = "outside the group" if e.sample >= group_size else "reported twice"
            raise StateError(
                f"progress[{k}].episodes[{j}].sample must be a sample of the group, once "
                f"(0 to group_size-1 = {group_size - 1}): got {e.sample}, {why}. Report each "
                f"sample of the prompt's group at most once.",
                field=f"progress.{k}.episodes.{j}.sample",
            )
        seen.add(e.sample)


class EpisodeBook:
    """The progress kept per prompt in flight, and what happened to it."""

    def __init__(
        self,
        log: ChangeLog,
        counts: dict[str, int],
        save: Callable[[], None],
        *,
        cap_bytes: int,
        group_size: int,
        put: Callable[[tuple[str, Any]], None],
        drop: Callable[[str], None],
    ):
        """``put((key, payload))`` and ``drop(key)``: the payload log's, through the
        ledger's tick (written before the commit, dropped after)."""
        self.log, self.counts, self.save = log, counts, save
        self.cap, self.group_size = cap_bytes, group_size
        self.put, self.drop = put, drop
        for name in COUNTS:
            counts.setdefault(name, 0)
        self.kept: dict[int, dict[str, Any]] = {}
        """Prompt index -> its record: ``rollout_id``, ``key``, ``bytes``, ``episodes``,
        ``turns`` (as journaled)."""
        self.bytes = 0

    def restore(self, tables: dict[str, dict[str, dict[str, Any]]]) -> None:
        self.kept = {int(k): dict(rec) for k, rec in tables.get("episodes", {}).items()}
        self.bytes = sum(rec["bytes"] for rec in self.kept.values())

    def keys(self) -> set[str]:
        """The payload-log keys the records refer to (a restart keeps these)."""
        return {rec["key"] for rec in self.kept.values()}

    def status(self) -> dict[str, int]:
        c = self.counts
        return {
            "held": len(self.kept),
            "held_bytes": self.bytes,
            "reports": c["episode_reports"],
            "unleased": c["episode_unleased"],
            "over_cap": c["episode_over_cap"],
            "resumed": c["episodes_resumed"],
            "turns_carried": c["episode_turns_carried"],
        }

    # -- reports -----------------------------------------------------------

    def report(
        self,
        prompts: PromptBook,
        replica_id: str,
        lease_id: str,
        progress: list[EpisodeProgress],
        *,
        now: float,
        finished: bool = False,
    ) -> dict[str, list[str]]:
        """Keep each report whose prompt attempt ``lease_id`` holds for ``replica_id``
        now, in place of the one kept before. Checks everything before keeping
        anything. Returns the rollout ids by verdict: ``kept``, ``unleased`` (not in
        the caller's live lease: the episode is someone else's, or done; or the job is
        ``finished``: nothing will be dispatched again), ``over_cap``."""
        parsed = [(p, *rollout_prompt(p.rollout_id)) for p in progress]
        for k, p in enumerate(progress):
            check_progress(k, p, self.group_size)
        out: dict[str, list[str]] = {"kept": [], "unleased": [], "over_cap": []}
        for p, idx, attempt in parsed:
            rid = p.rollout_id
            if finished or not prompts.holds(idx, attempt, lease_id, replica_id, now):
                self.counts["episode_unleased"] += 1
                out["unleased"].append(rid)
                continue
            blob = encode_bytes(p)
            size = len(blob)
            old = self.kept.get(idx)
            if self.bytes - (old["bytes"] if old else 0) + size > self.cap:
                self.counts["episode_over_cap"] += 1
                out["over_cap"].append(rid)
                continue
            self.counts["episode_reports"] += 1
            key = episode_key(rid, self.counts["episode_reports"])
            self.put((key, blob.decode()))
            if old is not None:
                self.drop(old["key"])
                self.bytes -= old["bytes"]
            rec = {
                "rollout_id": rid,
                "key": key,
                "bytes": size,
                "episodes": len(p.episodes),
                "turns": sum(len(e.turns) for e in p.episodes),
            }
            self.kept[idx] = rec
            self.bytes += size
            self.log.put("episodes", str(idx), rec)
            if rid not in out["kept"]:
                out["kept"].append(rid)
        if out["kept"]:
            prompts.renew(lease_id, now)  # its holder is alive and the episodes move on
        self.save()
        return out

    # -- dispatch and the end of a prompt's episodes -----------------------

    def resume(
        self,
        index: int,
        rollout_id: str,
        payload_of: PayloadOf,
        *,
        replica_id: str,
        lease_id: str,
        wall: float,
    ) -> EpisodeProgress | None:
        """The progress a prompt dispatched as ``rollout_id`` under ``lease_id`` carries
        (``PromptRef.resume``), or None. Progress of another attempt is dropped: its
        rollout was discarded, and the new attempt starts afresh. The progress stays
        kept (its new holder may die too) until the prompt is done."""
        rec = self.kept.get(index)
        if rec is None:
            return None
        progress = None
        raw = payload_of(rec["key"]) if rec["rollout_id"] == rollout_id else None
        if isinstance(raw, str):
            try:
                progress = EpisodeProgress.model_validate_json(raw)
            except ValidationError:  # not what was kept (a checksum passed a damaged record)
                progress = None
        if progress is None:
            self.forget(index)
            return None
        self.counts["episodes_resumed"] += 1
        self.counts["episode_turns_carried"] += rec["turns"]
        self.log.event(
            "episode_resumed",
            wall,
            rollout_id=rollout_id,
            replica_id=replica_id,
            lease_id=lease_id,
            episodes=rec["episodes"],
            turns=rec["turns"],
        )
        self.save()
        return progress

    def forget(self, index: int) -> None:
        """Drop prompt ``index``'s progress, if any (its rollout was accepted, the job
        finished, or the progress cannot be resumed from)."""
        rec = self.kept.pop(index, None)
        if rec is None:
            return
        self.bytes -= rec["bytes"]
        self.drop(rec["key"])
        self.log.put("episodes", str(index), None)

    def clear(self) -> None:
        """The job finished: nothing will be dispatched again."""
        for index in list(self.kept):
            self.forget(index)

    def reconcile(self, payload_of: PayloadOf) -> int:
        """At start: forget the records whose payload the payload log does not hold (a
        torn write, a lost file; an etcd standby's own log). Returns how many."""
        lost = [i for i, rec in self.kept.items() if payload_of(rec["key"]) is None]
        for index in lost:
            self.forget(index)
        return len(lost)

"""The checks a rollout submission passes before the ledger records any of it:
well-formed ids, and payloads that fit the job (or refs, when the rollout store
is outside the controller), and the record an accepted one becomes. A failed
check is a 400 naming the field."""

from __future__ import annotations

from typing import Any

from phalanx.config.rl import RLConfig
from phalanx.controller.core.base import StateError
from phalanx.protocol.rl import RolloutIn, parse_rollout_id


def rollout_prompt(rollout_id: str) -> tuple[int, int]:
    """``p<prompt>.<attempt>`` -> (prompt, attempt); a 400 naming the field if malformed."""
    try:
        return parse_rollout_id(rollout_id)
    except ValueError as e:
        raise StateError(str(e), field="rollouts.rollout_id") from None


def record(r: RolloutIn, idx: int, replica_id: str, ref: str | None) -> dict[str, Any]:
    """The ledger's record of an accepted rollout: its summary and its payload's ``ref``
    (None: submitted as discarded, no payload), never the payload itself."""
    return {
        "rollout_id": r.rollout_id,
        "prompt": idx,
        "version": r.version,
        "replica_id": replica_id,
        "reward": r.reward,
        "exact_match": r.exact_match,
        "ref": ref,
    }


def check_submission(rollouts: list[RolloutIn], rl: RLConfig, external_store: bool) -> None:
    """Refuse a submission whose payloads do not fit the job, before recording
    anything. ``external_store``: payloads live outside the controller (refs only)."""
    g, limit = rl.grpo, rl.completion_limit()
    what = "rl.env.max_episode_tokens" if rl.env is not None else "max_new_tokens"
    for k, r in enumerate(rollouts):
        rollout_prompt(r.rollout_id)
        if r.discard:
            continue  # no payload to check
        if external_store != (r.ref is not None):
            where = (
                "its ref in the job's rollout store"
                if external_store
                else ("its completions (this job's rollout store is the controller)")
            )
            raise StateError(
                f"rollouts[{k}] must carry {where}: check rl.transport.rollouts, which "
                f"must be the same for the controller and every replica.",
                field=f"rollouts.{k}",
            )
        if r.ref is not None:
            continue  # the payload is checked by the policy when it reads it
        comps = r.completions
        if len(comps) != g.group_size:
            raise StateError(
                f"rollouts[{k}].completions must hold group_size={g.group_size} "
                f"completions: got {len(comps)}. Submit every sample of the group.",
                field=f"rollouts.{k}.completions",
            )
        for j, c in enumerate(comps):
            if len(c.token_ids) != len(c.logprobs) or not c.token_ids:
                raise StateError(
                    f"rollouts[{k}].completions[{j}] must have one log-prob per token and "
                    f"at least one token: got {len(c.token_ids)} tokens, "
                    f"{len(c.logprobs)} log-probs.",
                    field=f"rollouts.{k}.completions.{j}",
                )
            if len(c.token_ids) > limit:
                raise StateError(
                    f"rollouts[{k}].completions[{j}] must have at most {what}="
                    f"{limit} tokens: got {len(c.token_ids)}.",
                    field=f"rollouts.{k}.completions.{j}.token_ids",
                )

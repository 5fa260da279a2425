"""Generate and score the rollouts of a prompt lease: one group of ``group_size``
completions per leased prompt, keyed by the prompt (so that a prompt
dispatched again regenerates the same completions under the same weights),
each scored by the task. A group whose scoring fails (a reward function raised or
timed out: :class:`~phalanx.rl.rewards.RewardError`) is submitted as discarded,
with the reason."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from phalanx.config.rl import RLConfig
from phalanx.protocol.rl import Completion, PromptRef, RolloutIn
from phalanx.rl.base import Task, Tokenizer
from phalanx.rl.engine.base import Completion as EngineCompletion
from phalanx.rl.engine.base import GenerationEngine, prompt_key
from phalanx.rl.rewards import RewardError

log = logging.getLogger("phalanx.rl.generate")


def score_group(
    task: Task, tok: Tokenizer, prompt: str, group: Sequence[EngineCompletion]
) -> list[tuple[float, bool]]:
    """(reward, exact match) of each completion of one prompt's group. Raises
    RewardError when a reward function raised or timed out: the whole group is then
    left untrained (a phalanx job discards the rollout, the single loop zeroes it)."""
    return [task.score(prompt, tok.decode(c.token_ids), c.finished) for c in group]


def make_rollouts(
    rl: RLConfig,
    engine: GenerationEngine,
    tok: Tokenizer,
    task: Task,
    prompts: list[PromptRef],
    between: Callable[[], None] | None = None,
) -> list[RolloutIn]:
    """One rollout per leased prompt, with its completions (the payload), as a
    submission to the ledger takes it. ``between`` goes to the engine's ``generate``
    (a weight update in flight); a rollout's version is then the oldest of its
    tokens', each completion listing its tokens' versions."""
    g = rl.grpo
    # A finite task's rows are used in epochs: prompt index i is row i mod N.
    texts = [task.prompts(p.index, 1)[0] for p in prompts]
    # The hook only when there is one: an engine without in-flight updates is called
    # exactly as before the ``between`` parameter existed.
    hook = {"between": between} if between is not None else {}
    comps = engine.generate(
        [tok.encode_prompt(t) for t in texts],
        g.group_size,
        g.max_new_tokens,
        g.temperature,
        keys=[prompt_key(g.seed, p.index) for p in prompts],
        **hook,
    )
    out = []
    for i, p in enumerate(prompts):
        group = comps[i * g.group_size : (i + 1) * g.group_size]
        rows, rewards, exact = [], [], []
        oldest = min(c.version for c in group)
        try:
            scores = score_group(task, tok, texts[i], group)
        except RewardError as e:
            log.warning("prompt %d: %s; its rollout is discarded", p.index, e)
            out.append(
                RolloutIn(
                    rollout_id=p.rollout_id,
                    version=oldest,
                    reward=0.0,
                    exact_match=0.0,
                    discard=str(e)[:300],
                )
            )
            continue
        for c, (r, em) in zip(group, scores, strict=True):
            r = float(r)
            rewards.append(r)
            exact.append(float(em))
            rows.append(
                Completion(
                    prompt_ids=list(c.prompt_ids),
                    token_ids=list(c.token_ids),
                    # log_softmax can round a sure token to a hair above 0.
                    logprobs=[min(lp, 0.0) for lp in c.logprobs],
                    finished=c.finished,
                    reward=r,
                    # Every token at the rollout's version when none is listed.
                    versions=c.token_versions() if c.versions or c.version != oldest else [],
                    mask=list(c.mask),
                )
            )
        out.append(
            RolloutIn(
                rollout_id=p.rollout_id,
                version=oldest,
                reward=sum(rewards) / len(rewards),
                exact_match=sum(exact) / len(exact),
                completions=rows,
            )
        )
    return out

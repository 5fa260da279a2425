"""Single-process GRPO: the baseline the elastic policy/rollout split is measured against.

Each round (a ``step`` in the printed lines): sync the engine to the policy's
weights (version = optimizer steps taken so far), sample G completions for each
of P fresh prompts, score them, compute group advantages, then take
``inner_epochs`` optimizer steps on the clipped GRPO loss over that batch.
Every round prints one JSON line (step, mean reward, exact match, seconds);
the run ends with a ``summary`` line giving the first step at which the
trailing mean reward and exact match reached 0.9.

With ``rl.loop.replay_ratio`` > 0 (and ``rl.transport.replay = "memory"``), each
round draws ``k = round(replay_ratio x prompts_per_step)`` groups from an
in-memory replay of the groups trained before (positions seeded by (seed,
round), as the controller's ledger draws them), with their stored completions,
behaviour log-probs and rewards, and generates the rest fresh; the round's
reward and exact match are the fresh groups'.

    python -m phalanx.jobs.rl_single --stop-at-exact-match 0.9
    python -m phalanx.jobs.rl_single --config rl.toml --grpo.lr 3e-3 --grpo.steps 200
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import sys
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from phalanx.config.rl import RLConfig, load_rl_config
from phalanx.jobs.base import JobError, ReplicaArgs
from phalanx.protocol.replay import positions
from phalanx.rl.corrections import staleness_histogram
from phalanx.rl.engine.base import prompt_key
from phalanx.rl.engine.hf import HFEngine
from phalanx.rl.generate import score_group
from phalanx.rl.grpo import group_advantages, lr_lambda, rows_to_train
from phalanx.rl.model import build_model, num_params
from phalanx.rl.rewards import RewardError
from phalanx.rl.step import Proximal, backward_rows, peak_memory_mb, prepare
from phalanx.rl.tasks import task_from_config
from phalanx.rl.tokenizer import task_tokenizer
from phalanx.transport.replay import MemoryReplayBuffer

log = logging.getLogger("phalanx.jobs.rl_single")

THRESHOLD = 0.9
"""Reward and exact-match level whose first crossing the summary reports."""


def train(
    cfg: RLConfig,
    *,
    stop_at_exact_match: float | None = None,
    window: int = 10,
    emit: Callable[[dict[str, Any]], None] | None = None,
    stop_at_reward: float | None = None,
) -> list[dict[str, Any]]:
    """Run GRPO for ``cfg.grpo.steps`` rounds in this process; return the per-round records.

    ``emit`` gets each record as it is made (the CLI prints them as JSON lines).
    With ``stop_at_exact_match`` (``stop_at_reward``), stops once the trailing
    ``window``-round mean exact match (reward) reaches it. Deterministic for a given config on one device and
    thread count.
    """
    before = torch.get_num_threads()
    if cfg.grpo.threads:
        torch.set_num_threads(cfg.grpo.threads)
    try:
        return _train(cfg, stop_at_exact_match, window, emit or (lambda rec: None), stop_at_reward)
    finally:
        torch.set_num_threads(before)


def single_replay(cfg: RLConfig) -> tuple[MemoryReplayBuffer | None, int]:
    """The baseline's replay and ``k``, the groups each round draws from it (None, 0:
    fresh rounds only). It lives in this process, so only ``memory`` is taken."""
    ratio, t = cfg.loop.replay_ratio, cfg.transport
    if ratio == 0:
        return None, 0
    if t.replay != "memory":
        raise JobError(
            f"the single-process GRPO baseline keeps its replay in memory: got "
            f'rl.transport.replay = {t.replay!r}. Set rl.transport.replay = "memory".'
        )
    p = cfg.grpo.prompts_per_step
    return MemoryReplayBuffer(t.replay_size), min(round(ratio * p), p - 1)


def _train(
    cfg: RLConfig,
    stop_at_exact_match: float | None,
    window: int,
    emit: Callable[[dict[str, Any]], None],
    stop_at_reward: float | None = None,
) -> list[dict[str, Any]]:
    g = cfg.grpo
    device = torch.device(g.device)
    tok = task_tokenizer(cfg.task)
    task = task_from_config(cfg.task)
    reward_errors = 0
    policy = prepare(build_model(cfg.model, tok, device).train(), g)
    engine = HFEngine(copy.deepcopy(policy), tok.eos_id, tok.pad_id, seed=g.seed)
    ref = None
    if g.kl_coef > 0:
        ref = copy.deepcopy(policy).eval().requires_grad_(False)
    opt = torch.optim.AdamW(
        policy.parameters(), lr=g.lr, betas=g.betas, weight_decay=g.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(g, g.steps * g.inner_epochs))
    emit({"event": "start", "params": num_params(policy), "config": cfg.dump()})

    records: list[dict[str, Any]] = []
    recent_r: deque[float] = deque(maxlen=window)
    recent_em: deque[float] = deque(maxlen=window)
    reached: dict[str, dict[str, Any]] = {}
    replay, k = single_replay(cfg)
    cursor = 0  # prompts of the task's stream taken so far
    t_start = time.perf_counter()
    for step in range(g.steps):
        t0 = time.perf_counter()
        # The weights version is the policy's optimizer-step count (DESIGN.md).
        engine.load_weights(policy.state_dict(), version=step * g.inner_epochs)
        drawn: list[dict[str, Any]] = []
        if replay is not None and 0 < k <= len(replay):
            drawn = replay.entries_at(positions(g.seed, step, len(replay), k))
        first = cursor
        prompts = task.prompts(first, g.prompts_per_step - len(drawn))
        cursor += len(prompts)
        comps = engine.generate(
            [tok.encode_prompt(p) for p in prompts],
            g.group_size,
            g.max_new_tokens,
            g.temperature,
            # Keyed as the rollout replicas key them: the same weights draw the same
            # completions here as in a phalanx job.
            keys=[prompt_key(g.seed, first + i) for i in range(len(prompts))],
        )
        rewards, em, fresh = [], [], []
        for i, prompt in enumerate(prompts):
            group = comps[i * g.group_size : (i + 1) * g.group_size]
            try:
                scores = score_group(task, tok, prompt, group)
            except RewardError as e:
                # As a phalanx job discards the rollout: all-equal rewards, no advantage.
                log.warning("prompt %d: %s; its group is not trained", first + i, e)
                reward_errors += 1
                scores = [(0.0, False)] * len(group)
            else:
                fresh.append({"rollout_id": f"p{first + i}", "comps": group, "scores": scores})
            rewards += [float(r) for r, _ in scores]
            em += [float(x) for _, x in scores]
        t_gen = time.perf_counter() - t0
        mean_r, mean_em = sum(rewards) / len(rewards), sum(em) / len(em)
        for d in drawn:  # stored completions, behaviour log-probs and versions, and rewards
            comps += d["comps"]
            rewards += [float(r) for r, _ in d["scores"]]
        adv = group_advantages(torch.tensor(rewards), g.group_size, g.adv_eps)
        n_tokens = sum(c.trained_tokens() for c in comps)
        keep = rows_to_train(adv, g.kl_coef)
        train_tokens = 0.0
        t_train = time.perf_counter()
        proximal = Proximal()  # the round's pi_prox, recorded by its first inner epoch
        for _ in range(g.inner_epochs):
            opt.zero_grad(set_to_none=True)
            stats = backward_rows(
                policy,
                comps,
                adv,
                keep,
                g=g,
                pad_id=tok.pad_id,
                num_tokens=n_tokens,
                ref=ref,
                proximal=proximal,
            )
            train_tokens += stats["train_tokens"]
            if g.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(policy.parameters(), g.grad_clip)
            opt.step()
            sched.step()
        if replay is not None:
            replay.add(fresh)
        now = time.perf_counter()
        recent_r.append(mean_r)
        recent_em.append(mean_em)
        # reward / exact_match: this round's fresh completions (at the sampling
        # temperature); replayed: groups drawn from the replay; *_avg: trailing means over `window` rounds; loss,
        # clip_frac, kl_behaviour and the off-policy metrics (mismatch_kl, ess,
        # is_*_frac, staleness_tokens): the round's last inner epoch; trained: rows
        # with a non-zero advantage that went through the backward pass.
        rec: dict[str, Any] = {
            "step": step + 1,
            "opt_steps": (step + 1) * g.inner_epochs,
            "reward": round(mean_r, 4),
            "exact_match": round(mean_em, 4),
            "reward_avg": round(sum(recent_r) / len(recent_r), 4),
            "exact_match_avg": round(sum(recent_em) / len(recent_em), 4),
            "len": round(n_tokens / len(comps), 3),
            "trained": len(keep),
            "replayed": len(drawn),
            "loss": round(stats["loss"], 5),
            "clip_frac": round(stats["clip_frac"], 4),
            "kl_behaviour": round(stats["kl_behaviour"], 6),
            "mismatch_kl": round(stats["mismatch_kl"], 6),
            "ess": round(stats["ess"], 4),
            "is_clip_frac": round(stats["is_clip_frac"], 4),
            "is_mask_frac": round(stats["is_mask_frac"], 4),
            # The last inner epoch trains from version (step + 1) * inner_epochs - 1.
            "staleness_tokens": staleness_histogram(
                ((c.version, c) for c in comps), (step + 1) * g.inner_epochs - 1
            ),
            "lr": sched.get_last_lr()[0],
            "entropy": round(stats["entropy"], 4),
            "gen_s": round(t_gen, 4),
            "gen_tokens_per_s": round(n_tokens / max(t_gen, 1e-9), 1),
            "train_tokens_per_s": round(train_tokens / max(now - t_train, 1e-9), 1),
            "peak_mem_mb": round(peak_memory_mb(device), 1),
            "step_s": round(now - t0, 4),
            "seconds": round(now - t_start, 3),
            "reward_errors": reward_errors,
        }
        records.append(rec)
        emit(rec)
        for key in ("reward_avg", "exact_match_avg"):
            if key not in reached and len(recent_r) == window and rec[key] >= THRESHOLD:
                reached[key] = {"step": rec["step"], "seconds": rec["seconds"]}
        full = len(recent_em) == window
        if (
            stop_at_exact_match is not None
            and full
            and rec["exact_match_avg"] >= stop_at_exact_match
        ) or (stop_at_reward is not None and full and rec["reward_avg"] >= stop_at_reward):
            break
    emit(
        {
            "event": "summary",
            "steps": len(records),
            "seconds": records[-1]["seconds"],
            "window": window,
            "threshold": THRESHOLD,
            "reached": reached,
        }
    )
    return records


def run(args: ReplicaArgs) -> int:
    """The baseline on a job config's ``[rl]`` sections, printing one JSON line per round."""
    if args.cfg.rl is None:
        raise JobError("the single-process GRPO baseline needs an [rl] section: got none.")
    if args.cfg.rl.env is not None:
        raise JobError(
            "the single-process GRPO baseline runs single-turn prompts only: this job has "
            "[rl.env]. Run it with phalanx run (its rollout replicas run the episodes)."
        )
    train(args.cfg.rl, emit=lambda rec: print(json.dumps(rec), flush=True))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m phalanx.jobs.rl_single",
        description="Single-process GRPO on one task; prints one JSON line per step. Any "
        "other --section.key VALUE is a config override (e.g. --grpo.lr 3e-3).",
    )
    parser.add_argument("--config", help="TOML file with [model], [task], [grpo] sections")
    parser.add_argument(
        "--stop-at-exact-match",
        type=float,
        default=None,
        help="stop once the trailing mean exact match reaches this",
    )
    parser.add_argument("--window", type=int, default=10, help="rounds in the trailing means")
    args, overrides = parser.parse_known_args(argv)
    cfg = load_rl_config(args.config, overrides)

    def emit(rec: dict[str, Any]) -> None:
        print(json.dumps(rec), flush=True)

    train(cfg, stop_at_exact_match=args.stop_at_exact_match, window=args.window, emit=emit)
    return 0


if __name__ == "__main__":
    sys.exit(main())

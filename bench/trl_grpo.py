"""TRL's ``GRPOTrainer`` on CPU with phalanx's GRPO hyper-parameters, stopped on a
trailing-mean reward: the TRL arm of ``bench/rl_peer.py`` (math) and of
``bench/rl_async.py`` (sort and math).

Every run: one optimizer pass per ``inner_epochs`` (TRL ``num_iterations``), no KL
(``beta = 0``), DAPO's clip-higher (``epsilon_high``) and token-level normalisation
(``loss_type="dapo"``), group-scaled advantages, a constant learning rate, the
dataset in its order (``shuffle_dataset=False``), seed 0, 2 torch threads.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

HP_KEYS = (
    "prompts_per_step",
    "group_size",
    "max_new_tokens",
    "temperature",
    "lr",
    "inner_epochs",
    "clip_eps",
    "clip_eps_high",
    "grad_clip",
)
"""What ``hp`` must hold: the fields of phalanx's ``[rl.grpo]`` of the same names."""


def trailing_stop(threshold: float, window: int, max_batches: int) -> Callable[[float], bool]:
    """A function fed each batch's mean reward in turn; it answers True once the trailing
    ``window``-batch mean reaches ``threshold`` or ``max_batches`` have been fed."""
    seen: list[float] = []

    def add(reward: float) -> bool:
        seen.append(reward)
        full = len(seen) >= window and sum(seen[-window:]) / window >= threshold
        return full or len(seen) >= max_batches

    return add


def train(
    work: Path,
    data: Any,
    reward: Callable[..., list[float]],
    hp: Mapping[str, Any],
    max_batches: int,
    on_reward: Callable[[Mapping[str, Any]], bool],
) -> None:
    """Train ``work/model`` (model and tokenizer, ``save_pretrained``) on ``data`` (a
    ``datasets.Dataset`` with a ``prompt`` column) with ``reward`` (TRL's reward
    function signature) for at most ``max_batches`` generated batches.
    ``on_reward(logs)`` gets every TRL log that carries a reward (one per generated
    batch: with ``num_iterations`` > 1 the other optimizer steps reuse the batch and
    log none) and stops training by returning True."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    missing = [k for k in HP_KEYS if k not in hp]
    if missing:
        raise ValueError(f"hp must hold {', '.join(HP_KEYS)}: {', '.join(missing)} missing.")
    torch.set_num_threads(2)

    class Stop(TrainerCallback):  # type: ignore[misc]
        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "reward" in logs and on_reward(logs):
                control.should_training_stop = True

    cfg = GRPOConfig(
        output_dir=str(work / "trl-out"),
        per_device_train_batch_size=hp["prompts_per_step"] * hp["group_size"],
        num_generations=hp["group_size"],
        max_completion_length=hp["max_new_tokens"],
        temperature=hp["temperature"],
        learning_rate=hp["lr"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=hp["grad_clip"],
        beta=0.0,
        num_iterations=hp["inner_epochs"],
        epsilon=hp["clip_eps"],
        epsilon_high=hp["clip_eps_high"] or hp["clip_eps"],
        loss_type="dapo",
        scale_rewards="group",
        max_steps=max_batches * hp["inner_epochs"],
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        seed=0,
        shuffle_dataset=False,
        disable_tqdm=True,
    )
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(work / "model")
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=cfg,
        train_dataset=data,
        processing_class=tok,
        callbacks=[Stop()],
    )
    trainer.train()

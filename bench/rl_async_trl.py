"""TRL's side of ``bench/rl_async.py`` on the sort task: the phalanx sort job's model,
exported to a Hugging Face directory, trained by TRL's ``GRPOTrainer`` on CPU with the
job's hyper-parameters and the sort task's own reward. (The math task's TRL arm is
``bench/rl_peer.py``'s, run as ``rl_peer.py --worker trl``.)

    python bench/rl_async_trl.py --work DIR --threshold T --window W --max-steps N

``DIR`` holds what :func:`export_sort` wrote (``model/``, ``sort.jsonl``, ``hp.json``).
The worker prints one JSON line per generated batch, ``{"t", "step", "reward"}``, and
stops once the trailing ``W``-batch mean reward reaches ``T`` (or after ``N`` batches).

What differs from phalanx, and why: TRL tokenizes the prompt without the BOS that
phalanx's character tokenizer puts first (``add_special_tokens=False``), and it
reads the completion's end from its ids (``finished``: EOS among them), which is
what phalanx's engine reports.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

TRL_ASYNC_SKIPPED = (
    "TRL 1.16's AsyncGRPOTrainer (trl.experimental.async_grpo) generates on an external "
    "vLLM server (vllm_server_base_url) and pushes weights into it over NCCL "
    "(WeightTransferClient), which needs CUDA GPUs; there is no CPU path, and this "
    "benchmark starts no vLLM server"
)


def export_sort(config: Path, work: Path, batches: int) -> dict[str, Any]:
    """Write the sort job's model (built from its ``[rl.model]``, the same init as the
    job's) with a tokenizer of the same ids to ``work/model``, its first
    ``batches x prompts_per_step`` prompts to ``work/sort.jsonl`` and the job's GRPO
    hyper-parameters to ``work/hp.json``. Returns the hyper-parameters."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from phalanx.config import load_config
    from phalanx.rl.model import build_model
    from phalanx.rl.tasks import SortTask
    from phalanx.rl.tokenizer import DIGITS_ALPHABET, CharTokenizer

    cfg = load_config(config)
    if cfg.rl is None:
        raise ValueError(f"{config} must be an RL job with an [rl] section: it has none.")
    char = CharTokenizer()
    specials = list(CharTokenizer.SPECIALS)
    vocab = {t: i for i, t in enumerate([*specials, *DIGITS_ALPHABET])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token=specials[char.pad_id]))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token=specials[char.pad_id],
        bos_token=specials[char.bos_id],
        eos_token=specials[char.eos_id],
    )
    model = build_model(cfg.rl.model, char)
    model.generation_config.pad_token_id = char.pad_id
    model.save_pretrained(work / "model")
    tok.save_pretrained(work / "model")
    g = cfg.rl.grpo
    task = SortTask(seed=cfg.rl.task.seed)
    rows = [{"prompt": task.prompt(i)} for i in range(batches * g.prompts_per_step)]
    (work / "sort.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    hp = {
        "seed": cfg.rl.task.seed,
        "prompts_per_step": g.prompts_per_step,
        "group_size": g.group_size,
        "max_new_tokens": g.max_new_tokens,
        "temperature": g.temperature,
        "lr": g.lr,
        "inner_epochs": g.inner_epochs,
        "clip_eps": g.clip_eps,
        "clip_eps_high": g.clip_eps_high,
        "grad_clip": g.grad_clip,
    }
    (work / "hp.json").write_text(json.dumps(hp))
    return hp


def train(work: Path, threshold: float, window: int, max_steps: int) -> None:
    """Run TRL's GRPOTrainer on the exported sort task (see the module docstring)."""
    from datasets import load_dataset
    from transformers import AutoTokenizer

    from phalanx.rl.tasks import SortTask
    from trl_grpo import trailing_stop
    from trl_grpo import train as trl_train

    hp = json.loads((work / "hp.json").read_text())
    task = SortTask(seed=hp["seed"])
    eos = AutoTokenizer.from_pretrained(work / "model").eos_token_id

    def reward(
        prompts: list[str], completions: list[str], completion_ids: list[list[int]], **_: Any
    ) -> list[float]:
        return [
            task.reward(p, c, eos in ids)
            for p, c, ids in zip(prompts, completions, completion_ids, strict=True)
        ]

    stop, step = trailing_stop(threshold, window, max_steps), [0]

    def on_reward(logs: Any) -> bool:
        step[0] += 1
        print(json.dumps({"t": time.time(), "step": step[0], "reward": logs["reward"]}), flush=True)
        return stop(float(logs["reward"]))

    ds = load_dataset("json", data_files=str(work / "sort.jsonl"), split="train")
    trl_train(work, ds, reward, hp, max_steps, on_reward)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--threshold", type=float, required=True)
    ap.add_argument("--window", type=int, required=True)
    ap.add_argument("--max-steps", type=int, required=True)
    a = ap.parse_args(argv)
    train(a.work, a.threshold, a.window, a.max_steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

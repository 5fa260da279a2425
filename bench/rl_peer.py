"""GRPO side by side with TRL (issue 16): the same model, data, reward and
hyper-parameters through TRL's ``GRPOTrainer``, phalanx's single-process loop, and
phalanx with 1 policy and 2 rollout replicas (HF engine, and vLLM where installed).

    python bench/rl_peer.py [--json] [--threshold 0.6] [--window 10] [--max-steps 300]
                            [--arms trl,single,phalanx,phalanx_vllm] [--keep DIR]

The task: one-digit additions (``"3+4="``, answer ``"7"``; all 100 of them, in a
seeded order), the reward math-verify's verdict (phalanx's built-in ``math``
reward, called by every arm), a Qwen2 causal LM built from config (random init,
seeded, 2 layers, hidden 64; a character-level tokenizer, so that a random model
can find a right answer by sampling) written with ``save_pretrained``, which every
arm loads. Every arm: 8 prompts x 8 completions per step, up to 3 new tokens,
temperature 1, AdamW lr 5e-4, constant, no KL, one optimizer step per batch,
clip 0.2 / 0.4 (DAPO's clip-higher, TRL's ``epsilon_high``), token-level loss
normalisation (TRL ``loss_type="dapo"``), group-normalised advantages.

TRL's trainer set-up is ``bench/trl_grpo.py`` (shared with ``bench/rl_async.py``).
Each arm runs in its own process, one after another, and stops once the trailing
``--window``-step mean reward reaches ``--threshold`` (or after ``--max-steps``).
Figures, per arm:

- ``time_to_threshold_s``: from the arm's launch (imports and model load included,
  for every arm alike) to the step whose trailing mean reached the threshold;
  None if it never did.
- ``gen_tokens_per_s``: completion tokens sampled and trained, over the arm's
  run time; ``train_tokens_per_s``: tokens through the policy's forward and
  backward (prompt and completion) over the same time.
- the reward curve, plotted to ``docs/img/rl_peer.png`` with ``--plot``.

With ``--json``: one object per arm, then ``{"ratio_vs_trl": {...}}``
(time_to_threshold_s of each arm / TRL's; the goal for ``phalanx`` is <= 0.5).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
P, G, MAX_NEW, LR = 8, 8, 3, 5e-4
PROMPT_TOKENS = 4  # "a+b="
ARMS = ("trl", "single", "phalanx", "phalanx_vllm")
WARM_STEPS = 150


# -- the shared setup ----------------------------------------------------------------


def write_data(path: Path) -> None:
    rows = [{"question": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    random.Random(0).shuffle(rows)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_model(out: Path) -> None:
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", *"0123456789+="])}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>"
    )
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head size 32: vLLM's CPU attention needs 32 or more
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    warm_start(model, tok)
    model.save_pretrained(out)
    tok.save_pretrained(out)


def warm_start(model: Any, tok: Any) -> None:
    """A short supervised pass on the additions whose first term is below 5, so that
    the checkpoint knows the answer format and some facts (RL post-training starts
    from a model that can sometimes answer): the other half it must find by sampling."""
    import torch

    seqs = [
        tok(f"{a}+{b}={a + b}")["input_ids"] + [tok.eos_token_id]
        for a in range(5)
        for b in range(10)
    ]
    width = max(len(x) for x in seqs)
    ids = torch.tensor([x + [tok.pad_token_id] * (width - len(x)) for x in seqs])
    labels = ids.masked_fill(ids == tok.pad_token_id, -100)
    labels[:, :PROMPT_TOKENS] = -100  # learn the answer, not the question
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(WARM_STEPS):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def job_toml(work: Path, threshold: float, window: int, steps: int) -> Path:
    path = work / "job.toml"
    path.write_text(
        f"""[job]
id = "rl-peer"
seed = 0

[timeouts]
collective_s = 10.0
heartbeat_s = 20.0
quorum_s = 60.0
heartbeat_interval_s = 0.5

[roles.policy]
min_replicas = 1
n_init_replicas = 1

[roles.rollout]
min_replicas = 1
n_init_replicas = 2

[rl.model]
path = "{work / "model"}"

[rl.task]
name = "dataset"
path = "{work / "add.jsonl"}"
prompt_field = "question"
answer_field = "answer"
tokenizer_path = "{work / "model"}"
rewards = ["math"]

[rl.grpo]
steps = {steps}
prompts_per_step = {P}
group_size = {G}
max_new_tokens = {MAX_NEW}
temperature = 1.0
lr = {LR}
inner_epochs = 1
clip_eps = 0.2
clip_eps_high = 0.4
grad_clip = 1.0
threads = 1

[rl.loop]
prompts_per_lease = 4
sync_every = 1
max_staleness = 1
max_ahead = 1
target_exact_match = 1.0
target_reward = {threshold}
window = {window}
"""
    )
    return path


# -- the arms (each in its own process) ------------------------------------------------


def emit(**rec: Any) -> None:
    print(json.dumps({"t": time.time(), **rec}), flush=True)


def worker_trl(work: Path, threshold: float, window: int, steps: int) -> None:
    from datasets import load_dataset

    from phalanx.rl.rewards import math_reward
    from trl_grpo import trailing_stop, train

    ds = load_dataset("json", data_files=str(work / "add.jsonl"), split="train")
    ds = ds.rename_column("question", "prompt")

    def reward(completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [math_reward("", c, a) for c, a in zip(completions, answer, strict=True)]

    stop, step = trailing_stop(threshold, window, steps), [0]

    def on_reward(logs: Any) -> bool:
        step[0] += 1
        emit(
            step=step[0],
            reward=logs["reward"],
            completion_tokens=logs.get("completions/mean_length", 0.0) * P * G,
        )
        return stop(float(logs["reward"]))

    hp = {
        "prompts_per_step": P,
        "group_size": G,
        "max_new_tokens": MAX_NEW,
        "temperature": 1.0,
        "lr": LR,
        "inner_epochs": 1,
        "clip_eps": 0.2,
        "clip_eps_high": 0.4,
        "grad_clip": 1.0,
    }
    train(work, ds, reward, hp, steps, on_reward)


def worker_single(work: Path, threshold: float, window: int, steps: int) -> None:
    from phalanx.config.rl import load_rl_config
    from phalanx.jobs.rl_single import train

    cfg = load_rl_config(work / "job.toml", ["--grpo.threads=2", f"--grpo.steps={steps}"])

    def on(rec: dict[str, Any]) -> None:
        if "reward" in rec:
            emit(step=rec["step"], reward=rec["reward"], completion_tokens=rec["len"] * P * G)

    train(cfg, window=window, emit=on, stop_at_reward=threshold)


# -- running and reading the arms ------------------------------------------------------


def run_worker(arm: str, work: Path, a: argparse.Namespace) -> tuple[float, list[dict[str, Any]]]:
    cmd = [sys.executable, __file__, "--worker", arm, "--work", str(work)]
    cmd += [
        "--threshold",
        str(a.threshold),
        "--window",
        str(a.window),
        "--max-steps",
        str(a.max_steps),
    ]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if p.returncode != 0:
        raise SystemExit(f"rl_peer: the {arm} arm failed:\n{p.stderr[-3000:]}")
    recs = []
    for line in p.stdout.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # the arm's own prints (TRL logs dicts)
        if isinstance(rec, dict) and "t" in rec and "reward" in rec:
            recs.append(rec)
    return t0, recs


def run_phalanx(arm: str, work: Path, a: argparse.Namespace) -> tuple[float, list[dict[str, Any]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = work / f"run-{arm}"
    cmd = [sys.executable, "-m", "phalanx.cli", "run", str(work / "job.toml"), "--plain"]
    cmd += ["--json", "--run-dir", str(run), f"--rl.grpo.steps={a.max_steps}"]
    if arm == "phalanx_vllm":
        cmd += ["--rl.engine.kind=vllm", "--rl.engine.max_model_len=64"]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, cwd=work)
    if p.returncode != 0:
        raise SystemExit(f"rl_peer: the {arm} arm failed:\n{p.stderr[-3000:]}\n{p.stdout[-2000:]}")
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    tokens = {e.step: e.value for e in acc.Scalars("rl/tokens")}
    recs = [
        {
            "t": e.wall_time,
            "step": e.step + 1,
            "reward": e.value,
            "completion_tokens": tokens.get(e.step, 0.0),
        }
        for e in acc.Scalars("rl/reward")
    ]
    return t0, recs


def figures(
    arm: str, t0: float, recs: list[dict[str, Any]], a: argparse.Namespace
) -> dict[str, Any]:
    hit = None
    rewards = [float(r["reward"]) for r in recs]
    for i in range(a.window - 1, len(recs)):
        if sum(rewards[i - a.window + 1 : i + 1]) / a.window >= a.threshold:
            hit = recs[i]
            break
    end = recs[-1]["t"] - t0 if recs else 0.0
    gen = sum(float(r["completion_tokens"]) for r in recs)
    return {
        "arm": arm,
        "time_to_threshold_s": round(hit["t"] - t0, 1) if hit else None,
        # From the first step's end: start-up (imports, model load, processes) left out.
        "training_time_to_threshold_s": round(hit["t"] - recs[0]["t"], 1) if hit else None,
        "startup_s": round(recs[0]["t"] - t0, 1) if recs else None,
        "steps_to_threshold": hit["step"] if hit else None,
        "reward_threshold": a.threshold,
        "window": a.window,
        "steps": len(recs),
        "run_s": round(end, 1),
        "gen_tokens_per_s": round(gen / end, 1) if end > 0 else None,
        "train_tokens_per_s": round((gen + PROMPT_TOKENS * P * G * len(recs)) / end, 1)
        if end > 0
        else None,
        "curve": [[round(r["t"] - t0, 2), round(float(r["reward"]), 4)] for r in recs],
    }


def vllm_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def plot(results: list[dict[str, Any]], out: Path, threshold: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        xs = [c[0] for c in r["curve"]]
        ys = [c[1] for c in r["curve"]]
        w = r["window"]
        trail = [sum(ys[max(0, i - w + 1) : i + 1]) / min(w, i + 1) for i in range(len(ys))]
        (line,) = ax.plot(xs, trail, label=f"{r['arm']} ({w}-step mean)", linewidth=1.8)
        ax.plot(xs, ys, color=line.get_color(), linewidth=0.6, alpha=0.35)
    ax.axhline(threshold, color="grey", linestyle="--", linewidth=0.8)
    ax.set_xlabel("seconds from launch")
    ax.set_ylabel("reward (thin: each batch)")
    ax.set_title("GRPO on one-digit addition: phalanx and TRL")
    ax.legend()
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threshold", type=float, default=0.6)
    ap.add_argument("--window", type=int, default=10)
    ap.add_argument("--max-steps", type=int, default=300)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--plot", type=Path, help="write the reward curves here (PNG)")
    ap.add_argument("--keep", type=Path, help="work directory to keep (default: a temp dir)")
    ap.add_argument("--worker", choices=("trl", "single"), help=argparse.SUPPRESS)
    ap.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker is not None:
        (worker_trl if a.worker == "trl" else worker_single)(
            a.work, a.threshold, a.window, a.max_steps
        )
        return 0
    arms = [x for x in a.arms.split(",") if x]
    bad = [x for x in arms if x not in ARMS]
    if bad:
        print(
            f"rl_peer: --arms must name {', '.join(ARMS)}: got {', '.join(bad)}.", file=sys.stderr
        )
        return 2
    if "phalanx_vllm" in arms and not vllm_installed():
        print("rl_peer: vLLM is not installed: the phalanx_vllm arm is left out.", file=sys.stderr)
        arms.remove("phalanx_vllm")
    work = a.keep or Path(tempfile.mkdtemp(prefix="rl-peer-"))
    work.mkdir(parents=True, exist_ok=True)
    write_data(work / "add.jsonl")
    write_model(work / "model")
    job_toml(work, a.threshold, a.window, a.max_steps)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results = []
    for arm in arms:
        runner = run_worker if arm in ("trl", "single") else run_phalanx
        t0, recs = runner(arm, work, a)
        res = figures(arm, t0, recs, a)
        results.append(res)
        if not a.json:
            print(
                f"{arm:>13}: {res['time_to_threshold_s']} s to reward {a.threshold} "
                f"({res['steps_to_threshold']} steps), gen {res['gen_tokens_per_s']} tok/s, "
                f"train {res['train_tokens_per_s']} tok/s",
                flush=True,
            )
    trl = next((r for r in results if r["arm"] == "trl"), None)
    ratios = {
        r["arm"]: round(r["time_to_threshold_s"] / trl["time_to_threshold_s"], 3)
        for r in results
        if trl and trl["time_to_threshold_s"] and r["time_to_threshold_s"] and r["arm"] != "trl"
    }
    training = {
        r["arm"]: round(r["training_time_to_threshold_s"] / trl["training_time_to_threshold_s"], 3)
        for r in results
        if trl
        and trl["training_time_to_threshold_s"]
        and r["training_time_to_threshold_s"]
        and r["arm"] != "trl"
    }
    if a.plot:
        plot(results, a.plot, a.threshold)
    if a.json:
        for r in results:
            print(json.dumps(r))
        print(json.dumps({"ratio_vs_trl": ratios, "training_ratio_vs_trl": training}))
    else:
        print(f"ratio_vs_trl: {ratios}; training only: {training}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

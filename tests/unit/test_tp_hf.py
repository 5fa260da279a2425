"""``[replica] tp`` (:mod:`phalanx.train.tp_hf`): what it refuses, in one line, before
any rank starts: in the config (a degree that does not divide the ranks, a
built-in task, an RL policy of gpt2 or with LoRA), and in ``phalanx run`` from the
model's directory (no plan, heads, key/value heads or an untied vocabulary that the
degree does not divide)."""

from __future__ import annotations

from pathlib import Path

import pytest

from phalanx import cli
from phalanx.config import ConfigError, load_config

RL = (
    "replica.ranks=2",
    "replica.tp=2",
    "roles.policy.min_replicas=1",
    "roles.rollout.min_replicas=1",
)
"""An RL job whose policy replicas are 2 ranks, TP over both."""


@pytest.mark.parametrize(
    ("overrides", "says"),
    [
        (["replica.ranks=4", "replica.tp=3"], "replica.tp must divide replica.ranks: got tp=3"),
        (["replica.ranks=2", "replica.tp=2"], "replica.tp applies to your Hugging Face model"),
        (
            ["replica.ranks=2", "replica.tp=2", "train.script=x.py"],
            "got train.script 'x.py'",
        ),
        ([*RL, "rl.grpo.steps=2"], "replica.tp must be 1 for a gpt2 policy built from config"),
        (
            [*RL, "rl.model.arch=llama", "rl.lora.r=4"],
            "replica.tp must be 1 with [rl.lora]: got 2",
        ),
    ],
)
def test_the_config_refuses_a_tp_it_cannot_run(overrides: list[str], says: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(overrides=overrides)
    # (ConfigError's form: a heading, then one line per refused key)
    assert [x for x in str(e.value).splitlines() if says in x], str(e.value)


def test_an_rl_policy_of_llama_may_be_tensor_parallel() -> None:
    cfg = load_config(overrides=[*RL, "rl.model.arch=llama"])
    assert cfg.rl is not None and cfg.replica.tp == 2 and cfg.replica.dp == 1


def _model_dir(root: Path, name: str, arch: str = "llama", **kw: int | bool) -> Path:
    """A model directory with only its config.json (what ``phalanx run`` reads)."""
    from transformers import GPT2Config, LlamaConfig

    d = root / name
    if arch == "gpt2":
        GPT2Config(n_embd=32, n_layer=1, n_head=2).save_pretrained(d)
    else:
        shape = dict(hidden_size=48, num_hidden_layers=1, intermediate_size=64, vocab_size=128)
        LlamaConfig(**{**shape, **kw}).save_pretrained(d)
    return d


@pytest.mark.parametrize(
    ("name", "arch", "shape", "says"),
    [
        ("gpt2", "gpt2", {}, "has no tensor-parallel plan in transformers"),
        ("heads", "llama", {"num_attention_heads": 3}, "must divide the model's attention heads"),
        (
            "kv",
            "llama",
            {"num_attention_heads": 4, "num_key_value_heads": 1},
            "must divide the model's key/value heads (1)",
        ),
        (
            "vocab",
            "llama",
            {"num_attention_heads": 4, "vocab_size": 129, "tie_word_embeddings": False},
            "must divide the model's vocabulary (129)",
        ),
    ],
)
def test_phalanx_run_refuses_a_model_the_tp_degree_does_not_fit(
    tmp_path: Path, name: str, arch: str, shape: dict[str, int], says: str
) -> None:
    model = _model_dir(tmp_path, name, arch, **shape)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("a b c\n")
    job = tmp_path / "job.toml"
    job.write_text(
        f'[train.model]\npath = "{model}"\n[train.data]\npath = "{corpus}"\n'
        "[replica]\nranks = 2\ntp = 2\n"
    )
    with pytest.raises(SystemExit) as e:
        cli.main(["run", str(job), "--plain", "--run-dir", str(tmp_path / "run")])
    msg = str(e.value.code)
    assert msg.startswith("phalanx run: replica.tp = 2") and "\n" not in msg, msg
    assert says in msg, msg
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_a_tied_vocabulary_need_not_divide() -> None:
    """A tied head stays replicated (as the embedding): only heads and MLP must divide."""
    from transformers import LlamaConfig

    from phalanx.train.tp_hf import check_config

    shape = dict(hidden_size=48, num_attention_heads=4, intermediate_size=64)
    check_config(LlamaConfig(**shape, vocab_size=129, tie_word_embeddings=True), 2)

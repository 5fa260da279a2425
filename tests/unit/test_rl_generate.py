"""make_rollouts with real components (the HF engine on a tiny model, the character
tokenizer, a dataset task): a group whose reward function fails is submitted as
discarded, with the reason, and the others are scored as usual."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from phalanx.config.rl import RLConfig
from phalanx.protocol.rl import PromptRef
from phalanx.rl.dataset_task import DatasetTask
from phalanx.rl.engine.hf import HFEngine
from phalanx.rl.generate import make_rollouts
from phalanx.rl.model import build_model
from phalanx.rl.rewards import Rewards
from phalanx.rl.tokenizer import load_tokenizer


def test_a_group_whose_reward_fails_is_submitted_as_discarded(tmp_path: Path):
    (tmp_path / "picky.py").write_text(
        "def picky(prompt, completion, answer):\n"
        "    if prompt == '31>':\n"
        "        raise KeyError('no rule for this row')\n"
        "    return float(completion == answer)\n"
    )
    data = tmp_path / "sort.jsonl"
    rows = [{"prompt": "21>", "answer": "12"}, {"prompt": "31>", "answer": "13"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sys.path.insert(0, str(tmp_path))
    try:
        rl = RLConfig.model_validate({"grpo": {"group_size": 4, "max_new_tokens": 3}})
        tok = load_tokenizer(None)
        engine = HFEngine(build_model(rl.model, tok), tok.eos_id, tok.pad_id)
        engine.version = 3
        task = DatasetTask(data, Rewards(["picky:picky"]))
        refs = [PromptRef(index=i, rollout_id=f"p{i}.0") for i in range(2)]
        torch.manual_seed(0)
        good, bad = make_rollouts(rl, engine, tok, task, refs)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("picky", None)
    assert good.discard == "" and len(good.completions) == 4 and good.version == 3
    assert all(c.reward in (0.0, 1.0) for c in good.completions)
    assert bad.rollout_id == "p1.0" and bad.completions == [] and bad.ref is None
    assert bad.discard == "reward picky:picky raised KeyError: 'no rule for this row'"


def test_a_finite_task_is_used_in_epochs(tmp_path: Path):
    """The controller's cursor runs past a dataset's end: prompt index i is row i mod N."""
    data = tmp_path / "two.jsonl"
    data.write_text('{"prompt": "21>", "answer": "12"}\n{"prompt": "31>", "answer": "13"}\n')
    rl = RLConfig.model_validate({"grpo": {"group_size": 2, "max_new_tokens": 3}})
    tok = load_tokenizer(None)
    engine = HFEngine(build_model(rl.model, tok), tok.eos_id, tok.pad_id)
    engine.version = 0
    task = DatasetTask(data, Rewards(["format"]))
    refs = [PromptRef(index=i, rollout_id=f"p{i}.0") for i in (1, 2, 5)]
    out = make_rollouts(rl, engine, tok, task, refs)
    assert [r.completions[0].prompt_ids for r in out] == [
        tok.encode(p) for p in ("31>", "21>", "31>")
    ]

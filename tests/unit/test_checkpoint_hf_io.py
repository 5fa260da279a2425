"""``phalanx ckpt export --format hf`` and ``phalanx ckpt import`` in one process,
on a tiny llama built from config: the quick version of
``tests/integration/test_checkpoint_hf.py`` (which runs real jobs and vLLM)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_checkpoint import cli

from phalanx.checkpoint import Checkpointer, CheckpointError, CheckpointStore


def llama(layers: int, tie: bool) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=tie,
    )  # fmt: skip
    torch.manual_seed(layers)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_export_hf_then_import_round_trips_bit_exact(
    tie: bool, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM

    src = tmp_path / "src"
    llama(2, tie).save_pretrained(src)
    trained = llama(2, tie)  # other weights than src's: the export must take the checkpoint's
    opt = torch.optim.AdamW(trained.parameters())
    trained(torch.tensor([[1, 2, 3]])).logits.sum().backward()
    opt.step()
    url = str(tmp_path / "ckpt")
    state = {"model": trained.state_dict(), "optimizer": opt.state_dict(), "step": 7}
    extra = {"config": {"train": {"model": {"path": str(src)}}}}
    Checkpointer(url).save(7, state, extra)

    out = tmp_path / "hf"
    rc, stdout, err = cli(capsys, "checkpoint", "export", url, "--format", "hf", str(out))
    assert rc == 0, err
    assert "of step 7" in stdout
    got = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert got.state_dict().keys() == trained.state_dict().keys()
    for k, v in got.state_dict().items():
        assert torch.equal(v, trained.state_dict()[k]), k
    assert got.config.tie_word_embeddings == tie

    back = str(tmp_path / "imported")
    rc, stdout, err = cli(capsys, "ckpt", "import", str(out), back)
    assert rc == 0, err
    assert "optimizer state: absent" in stdout and "starts a fresh optimizer" in stdout
    assert CheckpointStore(back).latest() == 0
    fresh = llama(2, tie)
    res = Checkpointer(back).load({"model": fresh.state_dict()})
    assert res is not None and "optimizer" not in res.state
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, trained.state_dict()[k]), k


def test_a_checkpoint_that_does_not_cover_the_model_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    small, deeper = tmp_path / "small", tmp_path / "deeper"
    llama(2, False).save_pretrained(small)
    llama(3, False).save_pretrained(deeper)
    url = str(tmp_path / "ckpt")
    rc, _, err = cli(capsys, "ckpt", "import", str(small), url)
    assert rc == 0, err

    # At export: the missing tensors, the first few and the count.
    rc, _, err = cli(
        capsys, "ckpt", "export", url, "--format", "hf", "--model-dir", str(deeper),
        str(tmp_path / "out"),
    )  # fmt: skip
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert "9 tensor(s) missing: 'model.layers.2.self_attn.q_proj.weight'" in err
    assert "and 5 more" in err
    # At resume: the job's load (the model's state_dict as template) refuses it alike.
    with pytest.raises(CheckpointError) as e:
        Checkpointer(url).load({"model": llama(3, False).state_dict()})
    msg = str(e.value)
    assert "\n" not in msg and "9 tensor(s) missing: 'model/model.layers.2." in msg
    # A checkpoint that names no model directory, and an import into a used root.
    rc, _, err = cli(capsys, "ckpt", "export", url, "--format", "hf", str(tmp_path / "o2"))
    assert rc == 0, err  # an import names its source directory
    rc, _, err = cli(capsys, "ckpt", "import", str(small), url)
    assert rc == 1 and "must be a new checkpoint root" in err
    rc, _, err = cli(capsys, "ckpt", "import", str(tmp_path / "nope"), str(tmp_path / "c2"))
    assert rc == 1 and "HF_DIR must be an existing local directory" in err

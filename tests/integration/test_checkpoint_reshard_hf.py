"""One checkpoint, any layout, on a Hugging Face model (issue 37): a llama built
from config trains AdamW steps under replicas x (FSDP x TP), one replica's ranks
save it, and other layouts load it bit-identical, model and optimizer.

The round trip is ``bench/big_models_reshard.py``'s (real gloo ranks started by
``phalanx.launch.ranks``, the job's own load path); this test runs it on a
smaller layout by default and on the issue's layouts when ``slow`` tests run,
and checks the state and the checkpoint's chunks itself.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from phalanx.checkpoint import CheckpointStore
from phalanx.train.snapshot import load_state

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "big_models_reshard", ROOT / "bench" / "big_models_reshard.py"
)
assert _spec is not None and _spec.loader is not None
bench = importlib.util.module_from_spec(_spec)
sys.modules["big_models_reshard"] = bench
_spec.loader.exec_module(bench)

Q = "model/model.layers.0.self_attn.q_proj.weight"
Q_MOMENT = "optimizer/state/{pid}/exp_avg"


def chunks(work: Path, key: str) -> list[tuple[list[int], list[int]]]:
    """(offsets, sizes) of each saved chunk of ``key``."""
    step = CheckpointStore(f"file://{work}/ckpt").latest()
    assert step is not None
    meta = json.loads((work / "ckpt" / f"step-{step:09d}" / ".metadata").read_text())
    return sorted((o, s) for o, s in meta["state_dict"][key]["chunks"])


def check_round_trip(out: dict[str, Any], work: Path, steps: int) -> None:
    assert out["reshard_bit_exact"], out["differences"]
    saved = load_state(work / "saved.st")
    # The saved state is a trained one (a load that did nothing would differ from it).
    moments = saved["optimizer"]["state"]
    assert len(moments) == len(list(saved["model"])) and out["tensors"] == 84
    assert all(float(st["step"]) == steps for st in moments.values())
    assert all(st["exp_avg_sq"].abs().sum() > 0 for st in moments.values())
    for layout in out["load_layouts"]:
        assert bench.differences(saved, load_state(work / f"{layout}.st")) == []


def test_hf_checkpoint_from_fsdp2_x_tp2_loads_bit_exact_in_other_layouts(tmp_path: Path) -> None:
    """Saved at 1 x (FSDP 2 x TP 2): every weight of the attention and MLP in 4
    chunks (2-D DTensors), AdamW's moments too; loaded at 1 x (TP 2) and in a
    single process, bit-identical."""
    out = bench.reshard("1x2x2", ("1x1x2", "1x1x1"), steps=2, work=tmp_path)
    check_round_trip(out, tmp_path, steps=2)
    assert chunks(tmp_path, Q) == [([r, 0], [16, 64]) for r in (0, 16, 32, 48)]
    saved = load_state(tmp_path / "saved.st")
    pid = list(saved["model"]).index(Q.removeprefix("model/"))
    assert len(chunks(tmp_path, Q_MOMENT.format(pid=pid))) == 4


@pytest.mark.slow
def test_hf_checkpoint_from_2_replicas_of_fsdp2_x_tp2_loads_in_every_layout(
    tmp_path: Path,
) -> None:
    """The issue's round trip: saved by replica 0 of 2 x (FSDP 2 x TP 2), loaded
    at 1 x (TP 2), at 3 x 1 (three one-rank replicas, each loading whole), in a
    single process, and back into FSDP 2 x TP 2 (the optimizer's moments cut
    like 2-D parameters), all bit-identical."""
    loads = ("1x1x2", "3x1x1", "1x1x1", "1x2x2")
    out = bench.reshard("2x2x2", loads, steps=3, work=tmp_path)
    check_round_trip(out, tmp_path, steps=3)
    assert len(chunks(tmp_path, Q)) == 4  # one replica's 4 ranks, not 8

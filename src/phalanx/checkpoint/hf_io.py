"""A checkpoint's model as a Hugging Face directory, and back (``phalanx ckpt
export --format hf``, ``phalanx ckpt import``): the universal checkpoint's way
out to ``from_pretrained`` and vLLM, and in from any HF causal LM.

**Export** loads the checkpoint whole through :class:`Checkpointer` (sizes and
CRC32s checked; any saving layout), takes the tensors under ``model/`` (the
FT jobs' ``state_dict`` names, which are the HF names: FSDP and TP keep them),
puts them into the architecture of the job's model directory (its
``config.json``, built on the meta device, so nothing is allocated twice) and
writes it with ``save_pretrained``: ``config.json``, ``model.safetensors``
(sharded past 5 GB, with its index), the generation config. The source
directory's other files (the tokenizer, its chat template) are copied. The
source is ``--model-dir``, else the job's ``[train.model] path`` (or ``[rl.model]
path``) recorded in the manifest, else the directory a checkpoint was imported
from. The tensors keep their saved dtype (fp32 master weights), bit for bit.

**Import** loads an HF directory (fp32, ``local_files_only``) and saves its
``state_dict`` as a committed checkpoint of step 0 under ``model/``: model only.
A job whose ``[train.model] path`` is a directory of the same architecture
resumes from it with those weights and a fresh optimizer (the optimizer's
moments are not in an HF directory).

A checkpoint whose tensors do not cover the architecture (another layer count,
another model) is refused in one line naming the missing tensors.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from phalanx.checkpoint.base import CheckpointError, IncompatibleCheckpoint, Manifest

PREFIX = "model"
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".index.json", ".ckpt")
"""Files of the source directory that are weights: never copied (the export writes its own)."""
WRITTEN = ("config.json",)


def source_dir(manifest: Manifest, model_dir: str | None) -> Path:
    """The HF directory whose architecture and tokenizer the export uses (module doc)."""
    if model_dir:
        found: str | None = model_dir
    else:
        cfg = manifest.extra.get("config") or {}
        paths = [
            ((cfg.get(section) or {}).get("model") or {}).get("path") for section in ("train", "rl")
        ]
        found = next((p for p in paths if p), None) or manifest.extra.get("imported_from")
    if not found:
        raise CheckpointError(
            f"checkpoint step {manifest.step} names no model directory (its job built its model "
            f"from config): pass --model-dir DIR, a save_pretrained directory of the same "
            f"architecture, for its config.json and tokenizer."
        )
    p = Path(found)
    if not (p / "config.json").is_file():
        raise CheckpointError(
            f"the model directory must hold a config.json: {str(p)!r} has none. Pass "
            f"--model-dir with the job's model directory (the one it trained from)."
        )
    return p


def hf_name(key: str) -> str:
    """The HF name of the checkpoint key ``model/<name>`` (``flatten``'s escapes undone)."""
    return key.removeprefix(f"{PREFIX}/").replace("%2F", "/").replace("%25", "%")


def check_covers(keys: set[str], want: list[str], what: str) -> None:
    """IncompatibleCheckpoint unless every name in ``want`` is in ``keys``."""
    from phalanx.checkpoint.checkpointer import few

    missing = [k for k in want if k not in keys]
    if missing:
        raise IncompatibleCheckpoint(
            f"the checkpoint's tensors must cover {what}: {len(missing)} tensor(s) missing: "
            f"{few(missing)}. "
            f"Export with --model-dir of the architecture the job trained."
        )


def export_hf(
    url: str,
    out: Path,
    *,
    step: int | None = None,
    model_dir: str | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Write step ``step`` (default: the latest) of the checkpoint root ``url`` as an
    HF directory ``out``. Returns what was written. CheckpointError says why not."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from phalanx.checkpoint.checkpointer import Checkpointer
    from phalanx.comm.transfer import flatten

    ck = Checkpointer(url, storage_options=storage_options)
    try:
        res = ck.load(step=step)
    finally:
        ck.close()
    if res is None:
        raise CheckpointError(f"{url} holds no committed checkpoint")
    src = source_dir(res.manifest, model_dir)
    _, tensors = flatten(res.state, keyed=True)
    weights = {hf_name(k): t for k, t in tensors.items() if k.startswith(f"{PREFIX}/")}
    cfg = AutoConfig.from_pretrained(str(src), local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    want = list(model.state_dict())
    check_covers(set(weights), want, f"the model of {src} ({type(model).__name__})")
    extra = sorted(set(weights) - set(want))
    if extra:
        raise IncompatibleCheckpoint(
            f"the checkpoint's model must be the architecture of {src}: it has {len(extra)} "
            f"tensor(s) that one lacks: {extra[:4]}. Pass --model-dir with the job's own model."
        )
    model.load_state_dict(weights, assign=True, strict=True)
    model.tie_weights()  # (tied heads: one tensor again, written once, as HF does)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.endswith(WEIGHTS) and f.name not in WRITTEN:
            shutil.copy2(f, out / f.name)
    model.save_pretrained(str(out), safe_serialization=True)
    gen = src / "generation_config.json"  # the source's own, not one derived from config
    if gen.is_file():
        shutil.copy2(gen, out / gen.name)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    return {"step": res.step, "url": res.url, "source": str(src), "tensors": len(weights),
            "nbytes": nbytes, "out": str(out)}  # fmt: skip


def import_hf(hf_dir: str, url: str, *, storage_options: dict[str, Any] | None = None) -> Manifest:
    """Save the causal LM in ``hf_dir`` as a model-only checkpoint of step 0 under
    ``url``. ValueError (from :func:`phalanx.rl.model.load_model`) for a directory that
    holds no causal LM."""
    from phalanx.checkpoint.checkpointer import Checkpointer
    from phalanx.rl.model import load_model

    model = load_model(hf_dir)
    src = str(Path(hf_dir).resolve())
    ck = Checkpointer(url, storage_options=storage_options, layout={"kind": "hf-import"})
    try:
        manifest = ck.save(0, {PREFIX: model.state_dict()}, {"imported_from": src})
    finally:
        ck.close()
    assert manifest is not None  # a single-process checkpointer is its own coordinator
    return manifest

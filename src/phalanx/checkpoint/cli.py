"""``phalanx ckpt list|inspect|export|import``: look into a checkpoint root from
the shell, turn a checkpoint's model weights into a plain safetensors file or
a Hugging Face directory, and an HF directory into a checkpoint
(:mod:`phalanx.checkpoint.hf_cli`).

Each command reads only committed checkpoints (those with a manifest).
``export`` loads through :class:`Checkpointer`, so it verifies sizes and
CRC32s first and exports exactly the bytes that were saved.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path
from typing import Any

from phalanx.checkpoint.base import CheckpointError, Manifest
from phalanx.checkpoint.store import CheckpointStore

FORMATS = ("safetensors", "hf")


def human_bytes(n: int) -> str:
    x = float(n)
    for unit in ("B", "KB", "MB", "GB"):
        if x < 1000 or unit == "GB":
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1000
    return f"{x:.1f} GB"


def _when(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).isoformat(sep=" ", timespec="seconds")


def _fail(command: str, message: str) -> SystemExit:
    return SystemExit(f"phalanx ckpt {command}: {message}")


def _storage_options(command: str, raw: str | None) -> dict[str, Any]:
    if not raw:
        return {}
    try:
        opts = json.loads(raw)
    except ValueError as e:
        raise _fail(
            command, f"--storage-options must be a JSON object: got {raw!r} ({e})."
        ) from None
    if not isinstance(opts, dict):
        raise _fail(command, f"--storage-options must be a JSON object: got {raw!r}.")
    return opts


def _store(command: str, args: argparse.Namespace) -> CheckpointStore:
    opts = _storage_options(command, getattr(args, "storage_options", None))
    try:
        return CheckpointStore(args.url, opts)
    except (ValueError, ImportError) as e:
        raise _fail(
            command,
            f"URL must be a path or an fsspec URL this install can open (file://, s3://, "
            f"memory://, ...): got {args.url!r} ({e}). For s3:// install the s3 extra "
            f"(pip install 'phalanx[s3]').",
        ) from None


def _steps(command: str, store: CheckpointStore) -> list[int]:
    try:
        steps = store.steps()
    except OSError as e:
        raise _fail(command, f"cannot list {store.url}: {e}") from None
    if not steps:
        raise _fail(
            command,
            f"{store.url} must hold at least one committed checkpoint: found none "
            f"(no step-*/phalanx.json). Check the URL (the storage root, not a step directory).",
        )
    return steps


def _pick(command: str, store: CheckpointStore, step: int | None) -> tuple[int, list[int]]:
    steps = _steps(command, store)
    if step is None:
        latest = store.latest()
        return (latest if latest is not None else steps[-1]), steps
    if step not in steps:
        raise _fail(
            command, f"--step must be a committed step: got {step}, expected one of {steps}."
        )
    return step, steps


def describe(store: CheckpointStore, step: int, steps: list[int], m: Manifest) -> dict[str, Any]:
    """What ``inspect --json`` prints: one checkpoint, and the root's steps."""
    from phalanx.checkpoint.dcp_io import dtype_of

    def nbytes(shape: tuple[int, ...], dtype: str) -> int:
        n = 1
        for d in shape:
            n *= d
        return n * dtype_of(dtype).itemsize

    return {
        "url": store.url_of(step),
        "root": store.url,
        "step": step,
        "steps": steps,
        "latest": store.latest(),
        "created_at": m.created_at,
        "save_id": m.save_id,
        "world_size": m.world_size,
        "layout": m.layout,
        "nbytes": m.nbytes,
        "files": m.files,
        "tensors": {
            k: {"shape": list(t.shape), "dtype": t.dtype, "nbytes": nbytes(t.shape, t.dtype)}
            for k, t in sorted(m.tensors.items())
        },
        "extra": m.extra,
    }


# -- commands ---------------------------------------------------------------


def ckpt_list(args: argparse.Namespace) -> int:
    store = _store("list", args)
    _steps("list", store)
    infos = store.checkpoints()
    latest = store.latest()
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "step": i.step,
                        "url": i.url,
                        "nbytes": i.nbytes,
                        "created_at": i.created_at,
                        "layout": i.layout,
                        "tensors": i.tensors,
                        "latest": i.step == latest,
                    }
                    for i in infos
                ]
            )
        )
        return 0
    print(f"{'step':>10}  {'size':>10}  {'tensors':>7}  {'created':19}  layout")
    for i in infos:
        mark = "  (latest)" if i.step == latest else ""
        layout = json.dumps(i.layout) if i.layout else "-"
        print(
            f"{i.step:>10}  {human_bytes(i.nbytes):>10}  {i.tensors:>7}  "
            f"{_when(i.created_at)}  {layout}{mark}"
        )
    return 0


def ckpt_inspect(args: argparse.Namespace) -> int:
    store = _store("inspect", args)
    step, steps = _pick("inspect", store, args.step)
    try:
        m = store.manifest(step)
        if args.verify:
            store.verify(step, m)
    except CheckpointError as e:
        raise _fail("inspect", f"checkpoint step {step} is unusable: {e}") from None
    d = describe(store, step, steps, m)
    if args.verify:
        d["verified"] = True
    if args.json:
        print(json.dumps(d))
        return 0
    print(f"checkpoint  {d['url']}")
    print(f"step        {step}   (committed steps: {steps}; latest: {d['latest']})")
    print(f"created     {_when(m.created_at)}")
    print(f"layout      world_size={m.world_size} {json.dumps(m.layout) if m.layout else ''}")
    print(f"size        {human_bytes(m.nbytes)} in {len(m.files)} files")
    for name, n in sorted(m.files.items()):
        print(f"  {name:<20} {human_bytes(n):>10}")
    if args.verify:
        print("verified    sizes and CRC32 of every chunk match the manifest")
    print(f"tensors     {len(d['tensors'])}")
    width = max((len(k) for k in d["tensors"]), default=0)
    for k, t in d["tensors"].items():
        shape = "x".join(str(s) for s in t["shape"]) or "scalar"
        print(f"  {k:<{width}}  {t['dtype']:<9} {shape:<16} {human_bytes(t['nbytes']):>10}")
    if m.extra:
        print(f"extra       {json.dumps(m.extra)}")
    return 0


def export_names(keys: list[str], prefix: str) -> dict[str, str]:
    """Checkpoint key -> exported name for the keys under ``prefix/``: the prefix
    stripped, each path segment unescaped, nested segments joined with ``.``
    (so a ``state_dict()`` saved as ``{"model": sd}`` gets its own names back)."""
    head = prefix.strip("/") + "/"
    out = {}
    for k in keys:
        if k.startswith(head):
            segs = k[len(head) :].split("/")
            out[k] = ".".join(s.replace("%2F", "/").replace("%25", "%") for s in segs)
    return out


def ckpt_export(args: argparse.Namespace) -> int:
    if args.format not in FORMATS:
        raise _fail("export", f"--format must be one of {list(FORMATS)}: got {args.format!r}.")
    store = _store("export", args)
    step, _ = _pick("export", store, args.step)
    if args.format == "hf" and not getattr(args, "config", None):
        # From the model directory (the job's, or --model-dir). With --config the
        # model is rebuilt from the job's spec and a LoRA adapter merged (below).
        from phalanx.checkpoint.hf_cli import export_command

        return export_command(args, store, step, _storage_options("export", args.storage_options))
    try:
        m = store.manifest(step)
    except CheckpointError as e:
        raise _fail("export", f"checkpoint step {step} is unusable: {e}") from None
    names = export_names(sorted(m.tensors), args.prefix)
    if not names:
        sample = sorted(m.tensors)[:3]
        raise _fail(
            "export",
            f"checkpoint step {step} must hold tensors under {args.prefix.strip('/') + '/'!r}: got "
            f"none (its keys look like {sample}). Pass --prefix with the subtree that holds "
            f"the model.",
        )
    from phalanx.checkpoint.checkpointer import Checkpointer
    from phalanx.tensorfile import save_file

    ck = Checkpointer(store.url, storage_options=_storage_options("export", args.storage_options))
    try:
        res = ck.load(step=step)
    except CheckpointError as e:
        raise _fail("export", str(e)) from None
    finally:
        ck.close()
    assert res is not None  # step is committed: load returns it or raises
    from phalanx.comm.transfer import flatten

    _, tensors = flatten(res.state, keyed=True)
    weights = {names[k]: t.contiguous() for k, t in tensors.items() if k in names}
    out = Path(args.out)
    if args.format == "hf":
        return _export_hf(weights, args, out, step)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(weights, out, metadata={"phalanx_step": str(step), "source": res.url})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    print(
        f"exported {len(weights)} tensors ({human_bytes(total)}) of step {step} from {res.url} "
        f"to {out}"
    )
    return 0


def _export_hf(weights: dict[str, Any], args: argparse.Namespace, out: Path, step: int) -> int:
    """``--format hf``: a full HF directory of the job's model (:mod:`.hf_export`)."""
    from phalanx.checkpoint.hf_export import export_hf

    if not args.config:
        raise _fail("export", "--format hf needs --config: the job file that names the model.")
    try:
        what = export_hf(weights, args.config, out)
    except (OSError, ValueError) as e:
        raise _fail("export", str(e)) from None
    print(f"exported step {step} ({what}) as a Hugging Face model directory to {out}")
    return 0


def ckpt_import(args: argparse.Namespace) -> int:
    from phalanx.checkpoint.hf_cli import import_command

    return import_command(args, _storage_options("import", args.storage_options))


COMMANDS = {
    "list": ckpt_list,
    "inspect": ckpt_inspect,
    "export": ckpt_export,
    "import": ckpt_import,
}


def run(args: argparse.Namespace) -> int:
    """Dispatch ``phalanx ckpt <command>`` (the parser lives in :mod:`phalanx.cli`)."""
    return COMMANDS[args.ckpt_command](args)

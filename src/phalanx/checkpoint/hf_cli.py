"""``phalanx ckpt export --format hf`` and ``phalanx ckpt import``: the shell side
of :mod:`phalanx.checkpoint.hf_io`, each failure one line (SystemExit)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from phalanx.checkpoint.base import CheckpointError
from phalanx.checkpoint.store import CheckpointStore


def _fail(command: str, message: str) -> SystemExit:
    return SystemExit(f"phalanx ckpt {command}: {message}")


def megabytes(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def export_command(
    args: argparse.Namespace, store: CheckpointStore, step: int, options: dict[str, Any]
) -> int:
    from phalanx.checkpoint.hf_io import export_hf

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise _fail(
            "export",
            f"OUT must be a directory for --format hf: {str(out)!r} is a file. Name a new "
            f"directory (it is created).",
        )
    try:
        got = export_hf(
            store.url, out, step=step, model_dir=args.model_dir, storage_options=options
        )
    except CheckpointError as e:
        raise _fail("export", f"checkpoint step {step}: {e}") from None
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _fail("export", f"cannot write the HF directory {str(out)!r}: {first}") from None
    print(
        f"exported {got['tensors']} tensors ({megabytes(got['nbytes'])}) of step {got['step']} "
        f"from {got['url']} to {out} as a Hugging Face model (config and tokenizer from "
        f"{got['source']})"
    )
    return 0


def import_command(args: argparse.Namespace, options: dict[str, Any]) -> int:
    from phalanx.checkpoint.hf_io import import_hf

    try:
        store = CheckpointStore(args.url, options)
        steps = store.steps()
    except (ValueError, ImportError, OSError) as e:
        raise _fail(
            "import", f"URL must be a path or an fsspec URL this install can write: {e}"
        ) from None
    if steps:
        raise _fail(
            "import",
            f"URL must be a new checkpoint root: {store.url} holds steps {steps}. Import into "
            f"an empty root and point checkpoint.url at it.",
        )
    try:
        m = import_hf(args.hf_dir, store.url, storage_options=options)
    except ValueError as e:
        raise _fail("import", str(e).replace("model.path", "HF_DIR")) from None
    except CheckpointError as e:
        raise _fail("import", str(e)) from None
    print(
        f"imported {len(m.tensors)} tensors ({megabytes(m.nbytes)}) from {args.hf_dir} as "
        f"checkpoint step {m.step} under {store.url}"
    )
    print(
        "optimizer state: absent (an HF directory holds none); a job resuming from this "
        "checkpoint starts a fresh optimizer"
    )
    return 0

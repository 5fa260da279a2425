"""Write a text corpus that every machine has: the Python standard library's source.

    python examples/make_corpus.py [--out data/stdlib] [--val-fraction 0.02]

One row per ``.py`` file of ``sysconfig.get_paths()["stdlib"]`` (its test suite
included, as code like any other), with ``text`` (the source) and ``path``
(relative to the stdlib), in sorted order of the paths, into ``OUT/train.jsonl``
and ``OUT/validation.jsonl``. The split is by file and deterministic: a file is
held out when a hash of its relative path falls below ``--val-fraction``, so the
same files are held out on every machine with the same Python. Left out:
``site-packages``, ``__pycache__``, and every file that is not valid Python 3 in
UTF-8 (the test suite's deliberately broken or Python 2 samples, which are test
*data*, not code).

The corpus of ``examples/pretrain_code.toml`` (``train.data.path`` is
``data/stdlib/train.jsonl``); ``examples/make_model.py --corpus data/stdlib``
trains its tokenizer on the train split. Another Python version has another
stdlib, hence another corpus: the script prints the version with the counts.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import sys
import sysconfig
import time
import warnings
from pathlib import Path

SKIP_DIRS = {"site-packages", "__pycache__"}


def held_out(rel: str, fraction: float) -> bool:
    """Whether the file at ``rel`` (relative, POSIX) goes to the validation split."""
    h = hashlib.blake2b(rel.encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") < fraction * 2.0**64


def source(path: Path) -> str | None:
    """The file's text when it is valid Python 3 in UTF-8, else None."""
    try:
        text = path.read_bytes().decode("utf-8")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escapes and the like: still code
            ast.parse(text, filename=str(path))
    except (UnicodeDecodeError, SyntaxError, ValueError):
        return None
    return text if text.strip() else None


def write(out: Path, val_fraction: float, root: Path | None = None) -> dict[str, list[int]]:
    """Write the two splits of the sources under ``root`` (None: the stdlib);
    {split: [files, bytes]}, and [files left out, 0] under "skipped"."""
    root = root or Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (f for f in root.rglob("*.py") if not SKIP_DIRS & set(f.relative_to(root).parts)),
        key=lambda f: f.relative_to(root).as_posix(),
    )
    out.mkdir(parents=True, exist_ok=True)
    counts = {"train": [0, 0], "validation": [0, 0], "skipped": [0, 0]}
    tmp = {s: out / f".{s}.jsonl.tmp" for s in ("train", "validation")}
    with tmp["train"].open("w") as tr, tmp["validation"].open("w") as va:
        for f in files:
            rel = f.relative_to(root).as_posix()
            text = source(f)
            if text is None:
                counts["skipped"][0] += 1
                continue
            split = "validation" if held_out(rel, val_fraction) else "train"
            (va if split == "validation" else tr).write(
                json.dumps({"text": text, "path": rel}) + "\n"
            )
            counts[split][0] += 1
            counts[split][1] += len(text.encode())
    for s, t in tmp.items():
        t.replace(out / f"{s}.jsonl")  # whole files or none, as a reader expects
    return counts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("data/stdlib"), help="output directory")
    ap.add_argument(
        "--val-fraction",
        type=float,
        default=0.02,
        help="fraction of the files held out for validation (0 < f < 1)",
    )
    a = ap.parse_args()
    if not 0 < a.val_fraction < 1:
        print(f"make_corpus: --val-fraction must be in (0, 1): got {a.val_fraction}.")
        return 2
    if a.out.exists() and not a.out.is_dir():
        print(f"make_corpus: --out must be a directory: got the file {str(a.out)!r}.")
        return 2
    start = time.monotonic()
    counts = write(a.out, a.val_fraction)
    version = ".".join(map(str, sys.version_info[:3]))
    for split in ("train", "validation"):
        n, size = counts[split]
        print(f"{a.out / (split + '.jsonl')}: {n} files, {size / 1e6:.1f} MB")
    print(
        f"Python {version} stdlib: {counts['skipped'][0]} files left out (not valid Python 3 "
        f"in UTF-8), {time.monotonic() - start:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Reading the rows of a training data set: which files, in which format, and in
which order (:mod:`phalanx.data.text` tokenizes them).

A *source* is a path resolved once into a format and an ordered list of files:

- a file: its format from its extension (``.jsonl``/``.json``: json, ``.parquet``,
  ``.arrow``, ``.txt``/``.text``/``.md``/``.rst``: text), or the one configured;
- a directory written by ``save_to_disk`` (it holds ``dataset_dict.json``, or
  ``state.json`` and ``dataset_info.json``): ``disk``, a ``Dataset`` or one split of
  a ``DatasetDict``;
- any other directory: every file under it, hidden ones skipped, in sorted order of
  their relative paths. They must all be of one format; with a configured format,
  the files of that format are read and the others ignored (``text`` reads them all).

Rows come out in that order, always the same for the same files, which is what
makes a row's index (and so a sample's) mean the same thing on every replica.
Text files are one row each (one document); the other formats are read with
``datasets``. A row's *label* ("row 7", "file pkg/mod.txt") names it in reports:
rows are numbered from 1 over the source's files in order.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from phalanx.data.errors import DataError, first_line

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst")
SUFFIXES = {
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
    **dict.fromkeys(TEXT_SUFFIXES, "text"),
}
TEXT_COLUMN = "text"
"""The one column of a text source (a whole file per row)."""


@dataclass(frozen=True)
class Source:
    """Data to read: the config field it came from (for errors), the path, its format,
    its files in reading order and, for a ``DatasetDict``, the split."""

    where: str
    path: Path
    format: str
    files: tuple[Path, ...]
    split: str = ""

    def identity(self) -> list[Any]:
        """What the rows depend on: the format, the split, and every file's path, size
        and modification time (a file rewritten in place is different data)."""
        out: list[Any] = [str(self.path.resolve()), self.format, self.split]
        for f in self.files:
            st = f.stat()
            out.append(
                [
                    str(f.relative_to(self.path)) if f != self.path else "",
                    st.st_size,
                    st.st_mtime_ns,
                ]
            )
        return out

    def describe(self) -> str:
        return f"{self.path}[{self.split}]" if self.split else str(self.path)


def _files_under(p: Path) -> list[Path]:
    out = []
    for f in sorted(p.rglob("*"), key=lambda f: f.relative_to(p).as_posix()):
        rel = f.relative_to(p).parts
        if f.is_file() and not any(part.startswith(".") for part in rel):
            out.append(f)
    return out


def disk_splits(p: Path) -> list[str] | None:
    """The splits of a ``DatasetDict`` saved at ``p``; None when ``p`` is not one."""
    meta = p / "dataset_dict.json"
    if not meta.is_file():
        return None
    try:
        return [str(s) for s in json.loads(meta.read_text())["splits"]]
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{meta} must be a datasets DatasetDict's metadata: {first_line(e)}") from e


def _is_disk(p: Path) -> bool:
    return (p / "dataset_dict.json").is_file() or (
        (p / "state.json").is_file() and (p / "dataset_info.json").is_file()
    )


def resolve(path: str, fmt: str, where: str) -> Source:
    """The :class:`Source` of ``path`` read as ``fmt`` (``auto``: detected). Raises
    :class:`DataError` in one line when it does not exist, has no files, or its
    format cannot be told or is mixed."""
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(
            f"{where} must be an existing file or directory: got {path!r}. Check the path "
            f"(relative paths start from the working directory {Path.cwd()})."
        )
    if p.is_file():
        if fmt == "disk":
            raise DataError(
                f"{where} must be a directory written by save_to_disk for format 'disk': got "
                f"the file {path!r}. Set train.data.format = 'auto'."
            )
        kind = fmt if fmt != "auto" else SUFFIXES.get(p.suffix.lower())
        if kind is None:
            raise DataError(
                f"{where} must end in one of {sorted(SUFFIXES)} for format 'auto': got "
                f"{path!r}. Set train.data.format (text reads any file as one document)."
            )
        return Source(where, p, kind, (p,))
    if fmt in ("auto", "disk") and _is_disk(p):
        return Source(where, p, "disk", tuple(_files_under(p)))
    if fmt == "disk":
        raise DataError(
            f"{where} must be a directory written by save_to_disk for format 'disk': {path!r} "
            f"holds no dataset_dict.json nor state.json. Set train.data.format = 'auto'."
        )
    files = _files_under(p)
    if fmt == "auto":
        kinds: dict[str, list[str]] = {}
        for f in files:
            kinds.setdefault(SUFFIXES.get(f.suffix.lower(), "unknown"), []).append(f.name)
        if "unknown" in kinds:
            raise DataError(
                f"{where} must hold files of a known format for format 'auto': got "
                f"{kinds['unknown'][:3]} in {path!r}. Set train.data.format (text reads any "
                f"file as one document) or move the other files out."
            )
        if len(kinds) > 1:
            mix = ", ".join(f"{k} ({v[0]}, ...)" for k, v in sorted(kinds.items()))
            raise DataError(
                f"{where} must hold files of one format: got {mix} in {path!r}. Move them "
                f"apart, or set train.data.format to read only the files of one format."
            )
        fmt = next(iter(kinds), "text")
    elif fmt != "text":
        files = [f for f in files if SUFFIXES.get(f.suffix.lower()) == fmt]
    if not files:
        raise DataError(
            f"{where} must hold at least one {fmt if fmt != 'auto' else 'data'} file: got none "
            f"in {path!r}."
        )
    return Source(where, p, fmt, tuple(files))


class Rows:
    """The rows of a source, read once in order."""

    def __init__(self, source: Source, hf_cache: Path):
        """``hf_cache``: where ``datasets`` may write its own Arrow copy of json,
        parquet and arrow files while the rows are read (the caller removes it)."""
        self.source = source
        self._ds: Any = None
        if source.format == "text":
            self.columns = [TEXT_COLUMN]
            self.count = len(source.files)
        else:
            self._ds = _load(source, hf_cache)
            self.columns = list(self._ds.column_names)
            self.count = len(self._ds)

    def close(self) -> None:
        """Let go of the dataset, whose files may then be removed."""
        self._ds = None
        self.count = 0

    def label(self, i: int) -> str:
        """How reports name row ``i`` (0-based)."""
        if self.source.format == "text":
            f = self.source.files[i]
            return f"file {f.relative_to(self.source.path) if f != self.source.path else f.name}"
        return f"row {i + 1}"

    def iter(self, fields: list[str], batch_size: int = 512) -> Iterator[dict[str, Any]]:
        """The rows in order, each a dict of ``fields``. A text file that is not UTF-8
        reads as its bytes: it cannot be tokenized, and is reported as such."""
        if self.source.format == "text":
            for f in self.source.files:
                raw = f.read_bytes()
                try:
                    yield {TEXT_COLUMN: raw.decode("utf-8")}
                except UnicodeDecodeError:
                    yield {TEXT_COLUMN: raw}
            return
        for batch in self._ds.select_columns(fields).iter(batch_size=batch_size):
            n = len(batch[fields[0]]) if fields else 0
            for j in range(n):
                yield {k: batch[k][j] for k in fields}


def _load(source: Source, hf_cache: Path) -> Any:
    import datasets

    datasets.disable_progress_bars()
    try:
        if source.format == "disk":
            ds: Any = datasets.load_from_disk(str(source.path))
            if isinstance(ds, datasets.DatasetDict):
                ds = ds[source.split]
            return ds
        return datasets.load_dataset(
            source.format,
            data_files=[str(f) for f in source.files],
            split="train",
            cache_dir=str(hf_cache),
        )
    except Exception as e:  # the library's own errors: unreadable, corrupt, empty
        raise DataError(
            f"{source.where} {source.describe()!r} must be readable as a {source.format} "
            f"dataset: {first_line(e)}"
        ) from e

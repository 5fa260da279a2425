"""Training data for Hugging Face models: ``[train.data]`` read with ``datasets``,
tokenized with the model's tokenizer, cut into fixed-length samples and cached.

Every replica of a job calls :func:`load_text_data` for the same split and gets the
same :class:`TextData`: sample ``i`` is a pure function of (the data's files, the
tokenizer, the settings that shape samples, ``i``), whoever computes it and
whenever. That is what the elastic sampler needs: it shuffles *indices* by seed
and shares them out, and exactly-once and the constant global batch hold only if
an index means the same tokens everywhere. So nothing here depends on the number
of replicas, on the process, or on the time: rows are read in a fixed order
(:mod:`phalanx.data.formats`), tokenized deterministically
(:mod:`phalanx.data.tokenize`), and a held-out row is chosen by a hash of (job seed,
row index), not by a random draw.

The first replica to arrive tokenizes the split into the cache
(:mod:`phalanx.data.cache`) while the others wait on its lock; they, and every
restarted replica, then read the cached arrays memory-mapped, without tokenizing.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from phalanx.config.data import DataSection
from phalanx.data import cache, tokenize
from phalanx.data.errors import DataError
from phalanx.data.formats import TEXT_COLUMN, Rows, Source, disk_splits, resolve

if TYPE_CHECKING:
    import torch  # imported when a batch is made: reading data needs no torch

__all__ = ["DataError", "TextData", "held_out", "load_text_data"]

log = logging.getLogger("phalanx.data.text")

SHOWN = 5
"""Reasons a warning about left-out rows shows (the cache keeps a few more)."""
IGNORE = -100
"""The label of a position without a loss (Hugging Face's ignore index)."""


class TextData:
    """One split of a tokenized dataset: sample i is a pure function of
    (the dataset's files, the tokenizer, the DataSection settings that matter, i).

    Built by :func:`load_text_data` from a cache entry; its arrays are memory-mapped,
    so it is cheap to hold and to share between threads.
    """

    seq_len: int
    skipped: int
    """Rows left out (not tokenizable, too long for SFT, a field missing)."""
    skipped_reasons: list[str]
    """The first few of them, e.g. ``"row 7: response is missing"``."""

    def __init__(self, entry: Path, meta: dict[str, Any]):
        self.path = entry
        """The cache entry the data is read from."""
        self.kind: str = meta["kind"]
        self.split: str = meta["split"]
        self.source: str = meta["source"]
        self.seq_len = int(meta["seq_len"])
        self.skipped = int(meta["skipped"])
        self.skipped_reasons = list(meta["skipped_reasons"])
        self.rows = int(meta["rows"])
        """Rows of the split, those left out included."""
        self.tokens = int(meta["tokens"])
        """Tokens in the samples (padding excluded)."""
        self.eos_id, self.pad_id = int(meta["eos_id"]), int(meta["pad_id"])
        self.vocab_size = int(meta["vocab_size"])
        """The tokenizer's ``len``; the model's vocabulary must be at least this large."""
        self.max_token_id = int(meta["max_token_id"])
        self._ids = np.load(entry / "input_ids.npy", mmap_mode="r")
        self._index = np.load(entry / "index.npy") if self.kind == "sft" else None

    def __len__(self) -> int:
        return len(self._ids) if self._index is None else len(self._index)

    def _check(self, indices: Sequence[int]) -> np.ndarray:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            bad = int(idx[(idx < 0) | (idx >= len(self))][0])
            raise IndexError(
                f"sample index must be in [0, {len(self)}): got {bad}. Indices come from an "
                f"ElasticSampler built with num_samples = len(data)."
            )
        return idx

    def batch(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, labels), both int64 [len(indices), seq_len] on the CPU; labels are
        -100 where there is no loss (SFT prompts and padding; pretraining has none).
        The model shifts labels itself (Hugging Face convention: labels = input_ids)."""
        import torch

        idx = self._check(indices)
        if self._index is None:
            ids = torch.from_numpy(np.asarray(self._ids[idx], dtype=np.int64))
            return ids, ids.clone()
        ids_np = np.full((len(idx), self.seq_len), self.pad_id, dtype=np.int64)
        labels = np.full((len(idx), self.seq_len), IGNORE, dtype=np.int64)
        for r, i in enumerate(idx):
            start, n, p = (int(x) for x in self._index[i])
            row = self._ids[start : start + n]
            ids_np[r, :n] = row
            labels[r, p:n] = row[p:]
        return torch.from_numpy(ids_np), torch.from_numpy(labels)

    def loss_tokens(self, indices: Sequence[int]) -> int:
        """Tokens with a loss in the samples ``indices``: positions 1.. whose label is not
        -100 (the model predicts position t from the ones before, so position 0 never
        carries a loss)."""
        idx = self._check(indices)
        if self._index is None:
            return len(idx) * (self.seq_len - 1)
        n, p = self._index[idx, 1], self._index[idx, 2]
        return int((n - np.maximum(p, 1)).sum())


def held_out(seed: int, row: int, fraction: float) -> bool:
    """Whether row ``row`` (0-based, in reading order) belongs to the validation split
    held out by ``validation_fraction`` under job seed ``seed``: a hash, so the same
    on every replica, and independent of every other row."""
    h = hashlib.blake2b(f"{seed}:{row}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") < fraction * 2.0**64


def _pick(p: Path, splits: list[str], want: str, where: str) -> str:
    if want in splits:
        return want
    if len(splits) == 1:
        return splits[0]
    raise DataError(
        f"{where} must be a DatasetDict with a {want!r} split (or a single split): got "
        f"splits {splits} in {str(p)!r}. Name one with train.data.validation, or save the "
        f"split you mean as {want!r}."
    )


def _source(spec: DataSection, split: str) -> tuple[Source, bool | None]:
    """The source of a split, and which rows of it to keep: all (None), those not held
    out (False) or those held out (True)."""
    train = resolve(spec.path, spec.format, "train.data.path")
    dd = disk_splits(train.path) if train.format == "disk" else None
    if split == "train":
        if dd is not None:
            train = replace(train, split=_pick(train.path, dd, "train", train.where))
        return train, (False if spec.validation_fraction else None)
    if spec.validation_fraction:
        return train, True
    if not spec.validation:
        raise DataError(
            "train.data.validation or train.data.validation_fraction must be set to load the "
            "validation split: got neither. Name held-out data, or hold out a fraction."
        )
    if dd is not None and spec.validation in dd:
        return replace(train, split=spec.validation), None
    if not Path(spec.validation).expanduser().exists() and dd is not None:
        raise DataError(
            f"train.data.validation must be a split of {spec.path!r} or a path: got "
            f"{spec.validation!r}; its splits are {dd}."
        )
    val = resolve(spec.validation, spec.format, "train.data.validation")
    vd = disk_splits(val.path) if val.format == "disk" else None
    if vd is not None:
        val = replace(val, split=_pick(val.path, vd, "validation", val.where))
    return val, None


def _fields(spec: DataSection, source: Source, columns: list[str]) -> list[str]:
    """The fields to read, checked against the data's ``columns``."""
    if source.format == "text":
        return [TEXT_COLUMN]
    where = f"{source.where} {source.describe()!r}"
    if spec.kind == "pretrain":
        if spec.text_field not in columns:
            raise DataError(
                f"train.data.text_field must be a field of {where}: got {spec.text_field!r}; "
                f"its fields are {columns}. Set train.data.text_field to one of them."
            )
        return [spec.text_field]
    has_pair = spec.prompt_field in columns and spec.response_field in columns
    if spec.messages_field not in columns and not has_pair:
        raise DataError(
            f"train.data.prompt_field and response_field, or messages_field, must be fields "
            f"of {where}: got {spec.prompt_field!r}, {spec.response_field!r} and "
            f"{spec.messages_field!r}; its fields are {columns}. Set them to the data's."
        )
    names = (spec.messages_field, spec.prompt_field, spec.response_field)
    return [f for f in names if f in columns]


def _build(
    spec: DataSection,
    source: Source,
    split: str,
    keep: bool | None,
    seed: int,
    tok_dir: Path,
    tmp: Path,
) -> dict[str, Any]:
    """Tokenize the split into the cache entry being built in ``tmp``; its meta."""
    start = time.monotonic()
    tok = tokenize.load_tokenizer(tok_dir)
    log.info("tokenizing %s (%s split) into %s", source.describe(), split, tmp.parent)
    hf = tmp / ".hf"  # datasets' own copy of the rows, gone once they are read
    rows = Rows(source, hf)
    fields = _fields(spec, source, rows.columns)
    skips, seen = tokenize.Skips(), [0]

    def labelled() -> Iterator[tuple[str, dict[str, Any]]]:
        for i, row in enumerate(rows.iter(fields)):
            if keep is None or held_out(seed, i, spec.validation_fraction) == keep:
                seen[0] += 1
                yield rows.label(i), row

    stream = cache.TokenFile(tmp / "tokens.bin")
    what = f"{source.where} {source.describe()!r} ({split} split)"
    if spec.kind == "pretrain":
        field = TEXT_COLUMN if source.format == "text" else spec.text_field
        tokenize.pretrain(tok, labelled(), field, skips, stream.write)
        _check_held_out(what, spec, keep, seen[0], rows.count)
        n = stream.count // spec.seq_len
        if n == 0:
            raise DataError(
                f"{what} must hold at least seq_len = {spec.seq_len} tokens: got "
                f"{stream.count} from {seen[0] - skips.count} of {seen[0]} rows"
                f"{_why(skips)}. Add data or lower train.data.seq_len."
            )
        stream.to_npy(tmp / "input_ids.npy", (n, spec.seq_len))
        arrays, samples, tokens = ["input_ids.npy"], n, n * spec.seq_len
    else:
        lengths = tokenize.sft(tok, labelled(), spec, skips, stream.write)
        _check_held_out(what, spec, keep, seen[0], rows.count)
        if not lengths:
            raise DataError(
                f"{what} must hold at least one usable row: got {seen[0]} rows, none usable"
                f"{_why(skips)}. Fix the rows or the train.data fields."
            )
        stream.to_npy(tmp / "input_ids.npy", (stream.count,))
        lens = np.asarray(lengths, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(lens[:, 0])[:-1]])
        np.save(tmp / "index.npy", np.stack([starts, lens[:, 0], lens[:, 1]], axis=1))
        arrays, samples, tokens = ["input_ids.npy", "index.npy"], len(lengths), stream.count
    rows.close()
    shutil.rmtree(hf, ignore_errors=True)
    return {
        "arrays": arrays,
        "kind": spec.kind,
        "max_token_id": stream.max_id,
        "rows": seen[0],
        "samples": samples,
        "seq_len": spec.seq_len,
        "skipped": skips.count,
        "skipped_reasons": skips.reasons,
        "source": source.describe(),
        "split": split,
        "tokenize_s": round(time.monotonic() - start, 3),
        "tokens": tokens,
        **tokenize.special_ids(tok),
    }


def _check_held_out(what: str, spec: DataSection, keep: bool | None, kept: int, rows: int) -> None:
    """A split of a fraction must keep a row (a small fraction of few rows may not)."""
    if keep is not None and rows and not kept:
        raise DataError(
            f"{what} must hold at least one row: validation_fraction "
            f"{spec.validation_fraction} of {rows} rows gives it none. Change "
            f"train.data.validation_fraction, or name held-out data in train.data.validation."
        )


def _why(skips: tokenize.Skips) -> str:
    return f" ({skips.count} left out, first {skips.reasons[0]})" if skips.reasons else ""


def load_text_data(
    spec: DataSection,
    tokenizer_dir: str | Path,
    *,
    split: Literal["train", "validation"] = "train",
    seed: int = 0,
    max_positions: int | None = None,
) -> TextData:
    """The ``split`` of ``spec``'s data, tokenized with the tokenizer in
    ``tokenizer_dir`` (a local model or tokenizer directory), from the cache or
    tokenized into it first.

    Every replica of a job may call it at once: one tokenizes, the others wait and
    read (see :mod:`phalanx.data.cache`). ``seed`` is the job's seed; it matters only
    to ``validation_fraction``. ``max_positions`` is the model's context, which
    ``spec.seq_len`` must not exceed. Rows left out are logged in one warning line
    (on every load, cached or not). Raises :class:`DataError` in one line for bad
    data or settings."""
    if split not in ("train", "validation"):
        raise DataError(f"split must be 'train' or 'validation': got {split!r}.")
    if max_positions is not None and spec.seq_len > max_positions:
        raise DataError(
            f"train.data.seq_len must be at most the model's context of {max_positions} "
            f"positions: got {spec.seq_len}. Lower train.data.seq_len."
        )
    source, keep = _source(spec, split)
    tok_dir = Path(tokenizer_dir).expanduser()
    if spec.kind == "pretrain":
        fields = [] if source.format == "text" else [spec.text_field]
    else:
        fields = [spec.prompt_field, spec.response_field, spec.messages_field]
    key = {
        "version": cache.VERSION,
        "data": source.identity(),
        "tokenizer": tokenize.tokenizer_identity(tok_dir),
        "kind": spec.kind,
        "seq_len": spec.seq_len,
        "fields": fields,
        "split": split,
        # The seed picks the held-out rows; without a fraction it changes nothing.
        "held_out": None if keep is None else [keep, seed, spec.validation_fraction],
    }
    root = cache.cache_root(spec.cache_dir)
    entry = cache.entry_dir(root, f"{source.path.name}-{split}-{spec.kind}", key)
    meta = cache.build_once(
        entry, key, lambda tmp: _build(spec, source, split, keep, seed, tok_dir, tmp)
    )
    data = TextData(entry, meta)
    if data.skipped:
        shown = ", ".join(data.skipped_reasons[:SHOWN])
        more = f" (and {data.skipped - SHOWN} more)" if data.skipped > SHOWN else ""
        log.warning(
            "%s (%s split): %d row(s) left out of %d: %s%s",
            data.source,
            split,
            data.skipped,
            data.rows,
            shown,
            more,
        )
    return data

"""The ``[train.data]`` section: the training data of a Hugging Face model, read with
``datasets``, tokenized with the model's tokenizer and cached (:mod:`phalanx.data.text`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataSection(_Section):
    """Where the samples of a training job come from and how they are cut.

    Sample i of a split is a pure function of the data files, the tokenizer, the
    fields below that shape it and i: the elastic sampler shuffles indices, so the
    same index must mean the same tokens on every replica and after every restart.
    """

    path: str = Field(min_length=1, max_length=4096)
    """The training data: a text file, a ``.jsonl``/``.json``, ``.parquet`` or
    ``.arrow`` file, a directory of such files (all of one format, read in sorted
    order, hidden files skipped), or a directory written by ``datasets``'
    ``save_to_disk`` (a ``Dataset``, or a ``DatasetDict`` whose ``train`` split is
    used). Relative paths are taken from the working directory."""
    format: Literal["auto", "text", "json", "parquet", "arrow", "disk"] = "auto"
    """How to read ``path`` (and ``validation``): ``auto`` tells from the file
    extensions (``.txt``, ``.text``, ``.md``, ``.rst``: text) or from a
    ``save_to_disk`` directory's metadata. ``text`` reads every file as one
    document, whatever its extension (a directory of source files)."""
    kind: Literal["pretrain", "sft"] = "pretrain"
    """``pretrain``: documents tokenized, an EOS after each, concatenated and cut into
    ``seq_len`` tokens, with a loss on every token. ``sft``: one row per sample,
    padded to ``seq_len``, with the loss on the response only."""
    text_field: str = Field("text", min_length=1, max_length=200)
    """pretrain: the field that holds a document (plain text files: the whole file is one)."""
    prompt_field: str = Field("prompt", min_length=1, max_length=200)
    """sft: the field of the prompt (rows without ``messages_field``)."""
    response_field: str = Field("response", min_length=1, max_length=200)
    """sft: the field of the response, which carries the loss."""
    messages_field: str = Field("messages", min_length=1, max_length=200)
    """sft: the field of a chat (a list of ``{role, content}`` whose last message is the
    assistant's): a row that has it goes through the tokenizer's chat template, with
    the loss on the last message."""
    seq_len: int = Field(512, ge=1, le=65536)
    """Tokens per sample. It must not exceed the model's context; an SFT row longer
    than it is left out (and counted), never truncated."""
    validation: str = Field("", max_length=4096)
    """The held-out data: a path (the same formats as ``path``) or the name of a split
    of the ``DatasetDict`` at ``path`` (``validation``). Empty: ``validation_fraction``."""
    validation_fraction: float = Field(0.0, ge=0.0, le=0.5)
    """With ``validation`` empty: hold out this fraction of the documents (pretrain) or
    rows (sft), each chosen by a hash of (job seed, row index), so every replica and
    every restart holds out the same ones. 0: no validation set."""
    val_every: int = Field(0, ge=0, le=10_000_000)
    """Committed steps between validation losses; 0: never."""
    val_samples: int = Field(64, ge=1, le=1 << 24)
    """Samples of the validation set each validation uses: the first ones, the same
    every time, so that successive losses compare."""
    cache_dir: str = Field("", max_length=4096)
    """Where tokenized data is cached (one directory per data, tokenizer and settings).
    Empty: ``$PHALANX_RUN_DIR/data-cache`` when that is set (the launchers set it),
    else ``~/.cache/phalanx/data``."""

    @model_validator(mode="after")
    def _consistent(self) -> DataSection:
        if self.validation and self.validation_fraction:
            raise ValueError(
                f"train.data.validation_fraction must be 0 when train.data.validation is set: "
                f"got validation={self.validation!r}, validation_fraction="
                f"{self.validation_fraction}. Keep one of the two."
            )
        if self.val_every and not self.has_validation:
            raise ValueError(
                f"train.data.val_every needs a validation set: got val_every={self.val_every} "
                f"with no validation and validation_fraction = 0. Set train.data.validation "
                f"or train.data.validation_fraction, or val_every = 0."
            )
        if self.kind == "sft" and self.format == "text":
            raise ValueError(
                "train.data.format must not be 'text' when train.data.kind is 'sft': plain "
                "text has no prompt and response fields. Use JSONL, Parquet or Arrow rows."
            )
        if self.kind == "sft" and self.prompt_field == self.response_field:
            raise ValueError(
                f"train.data.prompt_field and response_field must differ: got both "
                f"{self.prompt_field!r}."
            )
        return self

    @property
    def has_validation(self) -> bool:
        """Whether a validation split is configured."""
        return bool(self.validation) or self.validation_fraction > 0

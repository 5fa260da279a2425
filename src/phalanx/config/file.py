"""Reading config files: TOML, dotted CLI overrides, and validation errors
explained in one line, a clause per field. Shared by the job config and the RL config."""

from __future__ import annotations

import json
import tomllib
import typing
from pathlib import Path
from types import UnionType
from typing import Any

from pydantic import BaseModel, ValidationError


class ConfigError(ValueError):
    """A config that cannot be used. The message says what to change."""


def _coerce(text: str, kind: str) -> Any:
    """Parse a CLI override value as JSON where it is JSON, else keep the string. A field
    that takes text (``kind`` "text", or "text?" where it may be None) keeps the text as
    given: ``--job.id 42`` is the id "42", not the number 42."""
    if kind == "text" or (kind == "text?" and text != "null"):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _kind(model: type[BaseModel] | None, parts: list[str]) -> str:
    """What the field at ``parts`` of ``model`` takes: "text", "text?" (text or None)
    or "value" (anything else, or a field no model declares)."""
    for i, part in enumerate(parts):
        field = model.model_fields.get(part) if model is not None else None
        if field is None:
            return "value"
        ann = field.annotation
        union = typing.get_origin(ann) in (typing.Union, UnionType)
        args = typing.get_args(ann) if union else (ann,)  # list[str] is a list, not text
        types = [a for a in args if a is not type(None)]
        if i == len(parts) - 1:
            if types == [str]:
                return "text?" if len(types) < len(args) else "text"
            return "value"
        model = next((t for t in types if isinstance(t, type) and issubclass(t, BaseModel)), None)
    return "value"


def apply_overrides(
    data: dict[str, Any], overrides: list[str], model: type[BaseModel] | None = None
) -> dict[str, Any]:
    """Apply ``--a.b.c VALUE`` / ``a.b.c=VALUE`` overrides onto a raw config dict
    (``model``: the config class, whose text fields keep their value as text)."""
    items: list[tuple[str, str]] = []
    i = 0
    while i < len(overrides):
        token = overrides[i]
        if not token.startswith("--") and "=" not in token:
            raise ConfigError(
                f"config override must look like --section.key VALUE or section.key=VALUE: "
                f"got {token!r}."
            )
        token = token.removeprefix("--")
        if "=" in token:
            key, value = token.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(overrides):
                raise ConfigError(f"config override --{token} needs a value: got none.")
            key, value = token, overrides[i + 1]
            i += 2
        items.append((key, value))
    for key, value in items:
        parts = key.split(".")
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"config override {key}: {part} is a value, not a section.")
            node = child
        node[parts[-1]] = _coerce(value, _kind(model, parts))
    return data


def explain(err: ValidationError, what: str, source: str) -> str:
    """A validation error as one line: ``invalid <what> <source>: <field>: <problem>``,
    several problems joined by ``; `` (the house rule: bad input is one line)."""
    problems = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key; check its spelling against the documented fields"
        problems.append(f"{where}: {' '.join(msg.split())}")
    return f"invalid {what} {source}: " + "; ".join(problems)


def read_toml(path: str | Path | None, what: str) -> tuple[dict[str, Any], str]:
    """Parse a TOML file (``{}`` when ``path`` is None). Returns (data, source name)."""
    if path is None:
        return {}, "(defaults)"
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what} {p} must be an existing TOML file: not found.")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8")), str(p)
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{what} {p} is not UTF-8 text: byte {e.start} is {e.object[e.start : e.start + 1]!r}. "
            f"Save the file as UTF-8."
        ) from None
    except OSError as e:
        raise ConfigError(f"{what} {p} cannot be read: {e.strerror or e}.") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what} {p} is not valid TOML: {e}.") from e

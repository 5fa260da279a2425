"""The one error of the data pipeline (:mod:`phalanx.data.text`), shared by its modules."""

from __future__ import annotations


class DataError(ValueError):
    """Bad data or settings, in one line (the job prints it and exits with code 78)."""


def first_line(e: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message`` of a library's exception, for a one-line error."""
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:limit]}" if text else type(e).__name__

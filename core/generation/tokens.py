"""Prompt rows as token ids: the one check every entry point (Session, run, the engine) applies.

A leaf module (it imports only :mod:`core.errors`), so the session, the generation iterators
and the engine share it without an import circle.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from core.errors import RequestError


def _short(value: Any) -> str:
    """``repr(value)`` cut to 60 characters, for error messages."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def token_row(index: int, row: Any) -> np.ndarray:
    """Prompt ``index`` as int64 ``[T]``, T >= 1.

    Raises:
        RequestError: the row is not a flat, non-empty sequence of integers (a nested list,
            None, a float, a bool or a string in it; the message says which).
    """
    if isinstance(row, (str, bytes)) or not isinstance(row, Sequence | np.ndarray) \
            or (isinstance(row, np.ndarray) and row.ndim != 1):
        raise RequestError(f"prompt {index} must be a list of integer token ids, got {_short(row)}")
    if len(row) == 0:
        raise RequestError(f"prompt {index} is empty; every row needs at least one token")
    if isinstance(row, np.ndarray) and row.dtype.kind in "iu":
        if row.dtype.kind == "u" and int(row.max()) >= 1 << 63:
            raise RequestError(f"prompt {index} has token ids beyond int64: {int(row.max())}")
        return row.astype(np.int64)
    for i, tok in enumerate(row):
        if isinstance(tok, (bool, np.bool_)) or not isinstance(tok, (int, np.integer)):
            if tok is None:
                what = "None"
            elif isinstance(tok, Sequence | np.ndarray) and not isinstance(tok, str):
                what = "a nested list"
            else:
                what = f"{type(tok).__name__} {_short(tok)}"
            raise RequestError(f"prompt {index} must be a list of integer token ids; token {i} is {what}")
        if not -(1 << 63) <= tok < 1 << 63:  # an int64 cannot hold it (NumPy would raise OverflowError)
            raise RequestError(f"prompt {index}: token {i} ({_short(tok)}) is not a token id")
    return np.asarray(row, dtype=np.int64)

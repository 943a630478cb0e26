"""Reference greedy selection with the non-finite policy shared by every provider."""

import numpy as np


def argmax_rows(rows: np.ndarray) -> np.ndarray:
    """Per-row ``[token_id, capture_error]`` (int32 ``[B, 2]``) for logits ``rows`` ``[B, V]``.

    token_id is the lowest index of the row maximum (numpy.argmax; docs/cases.md 11). A row holding a
    NaN or an infinity gets ``[-1, 1]``: flagged, never a silent token 0 (docs/cases.md 12).
    """
    rows = np.asarray(rows, dtype=np.float32)
    out = np.empty((rows.shape[0], 2), np.int32)
    bad = ~np.isfinite(rows).all(axis=-1)
    out[:, 0] = np.where(bad, -1, np.argmax(rows, axis=-1))
    out[:, 1] = bad
    return out

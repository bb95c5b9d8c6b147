"""Growing numpy arrays in place: the tree's and the page table's per-block state.

`ndarray.resize` reallocates; a large array lives in its own mapping, which the C library moves
(`mremap`) rather than copies, so growing a 300 MB array does not briefly need 600 MB. The growth
factor is small because numpy zero-fills the new rows, and rows filled are resident.
"""

from __future__ import annotations

import numpy as np

GROWTH = 1.25


def grow_rows(array: np.ndarray, min_rows: int, fill: int = 0) -> np.ndarray:
    """`array` (which must own its data and have no views) with at least `min_rows` rows; new rows
    hold `fill`. Returns the same object, resized."""
    rows = len(array)
    if min_rows <= rows:
        return array
    new_rows = max(min_rows, int(rows * GROWTH) + 16)
    array.resize((new_rows, *array.shape[1:]), refcheck=False)
    if fill:
        array[rows:] = fill
    return array

"""Numpy arrays for the tree's and the page table's per-block state: zeroed lazily, grown in place.

`lazy_zeros` allocates without asking the kernel for transparent huge pages. numpy advises
huge pages for every large array; where the kernel then tries, and fails, to find one at each
first touch (THP in `madvise` mode with direct defrag, as on the 2-core VM these replays are
measured on), writing 384 MB of fresh rows took 0.98 s against 0.33 s without the advice. Rows
are touched once, in order, as blocks are added, so huge pages would save little when they work.

`ndarray.resize` reallocates; a large array lives in its own mapping, which the C library moves
(`mremap`) rather than copies, so growing a 300 MB array does not briefly need 600 MB. The growth
factor is small because numpy zero-fills the new rows, and rows filled are resident.
"""

from __future__ import annotations

from typing import Any

import numpy as np

GROWTH = 1.25

_set_madvise_hugepage = getattr(getattr(np, "_core", np).multiarray, "_set_madvise_hugepage", None)
"""numpy's switch (None in a numpy without it: its default advice stands)."""


def lazy_zeros(shape: int | tuple[int, ...], dtype: Any, fill: int = 0) -> np.ndarray:
    """`np.full(shape, fill, dtype)` without huge-page advice: with fill 0, memory is only taken
    when a row is first written."""
    previous = _set_madvise_hugepage(False) if _set_madvise_hugepage is not None else None
    try:
        return np.zeros(shape, dtype=dtype) if fill == 0 else np.full(shape, fill, dtype=dtype)
    finally:
        if previous is not None and _set_madvise_hugepage is not None:
            _set_madvise_hugepage(previous)


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

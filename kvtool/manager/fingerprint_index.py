"""Node ids by 64-bit fingerprint: an open-addressing hash table over numpy arrays.

A radix tree of millions of blocks cannot afford a Python dict entry and an int object a block.
Here a block costs a 4-byte table cell at load below 1/2 (its fingerprint is its owner's array),
and a whole prompt's blocks are looked up or added in a few vectorised passes.

Fingerprints are well mixed: the low bits pick the home cell and the high bits the (odd) probe
step, so probing is double hashing without computing another hash. Several ids may share a
fingerprint; a lookup answers the first one placed on the probe sequence, and `all_of` every one
(the owner tells which is the block it wants).
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from kvtool.errors import LogicError
from kvtool.manager.growable import lazy_zeros

EMPTY = -1
REMOVED = -2
"""Cell values besides an id: never used, and used once (a probe goes on past it)."""

_32, _1 = np.uint64(32), np.uint64(1)
_SCALAR_BELOW = 8
"""Keys still probing when a vectorised round is not worth its fixed cost."""
_MIN_CELLS = 1 << 10
_MAX_LOAD = 0.5
"""Live plus removed cells above this share of the table: rebuild (grow when live alone is high)."""


class FingerprintIndex:
    """A set of ids (small non-negative ints) whose fingerprints are `values[id]`; find ids by
    fingerprint.

    Contract: the owner writes `values[id]` before `add_many(id)` and keeps it until the id is
    removed; it may grow `values` in place (`ndarray.resize`), never replace it. `add_many` takes
    ids not in the set, `remove_many` ids in it.
    """

    def __init__(self, values: np.ndarray, expected: int = _MIN_CELLS) -> None:
        """Sized for `expected` ids without a rebuild."""
        cells = _MIN_CELLS
        while expected > _MAX_LOAD * cells:
            cells *= 2
        self._values = values
        self._cells = lazy_zeros(cells, np.int32, EMPTY)
        self._mask = cells - 1
        self._num_live = 0
        self._num_removed = 0

    def __len__(self) -> int:
        return self._num_live

    # ---- lookups -----------------------------------------------------------------------------
    def first_many(self, fingerprints: np.ndarray) -> np.ndarray:
        """For each fingerprint, the first id on its probe sequence that has it, or EMPTY (int64)."""
        if len(fingerprints) == 1:   # one key does not pay a vectorised round's fixed cost
            fingerprint = int(fingerprints[0])
            at, step = self._start_one(fingerprint)
            return np.array([self._walk(fingerprint, at, step, None)[0]], dtype=np.int64)
        return self._probe(np.asarray(fingerprints, dtype=np.uint64), None)[0]

    def all_of(self, fingerprint: int) -> list[int]:
        """Every id with this fingerprint, in probe order."""
        found = []
        at, step = self._start_one(fingerprint)
        while (cell := int(self._cells[at])) != EMPTY:
            if cell >= 0 and int(self._values[cell]) == fingerprint:
                found.append(cell)
            at = (at + step) & self._mask
        return found

    def contains_many(self, ids: np.ndarray) -> np.ndarray:
        """Whether each id is in the set (its own fingerprint's probe sequence reaches it)."""
        ids = np.asarray(ids, dtype=np.int64)
        return self._probe(self._values[ids], ids)[1] >= 0

    def ids(self) -> np.ndarray:
        """Every id in the set (table order)."""
        return self._cells[self._cells >= 0].astype(np.int64)

    def id_chunks(self, size: int) -> Iterator[np.ndarray]:
        """`ids()` a chunk of the table at a time (int32)."""
        for start in range(0, len(self._cells), size):
            cells = self._cells[start:start + size]
            yield cells[cells >= 0]

    # ---- changes -----------------------------------------------------------------------------
    def add_many(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids):
            return
        self._reserve(len(ids))
        self._place(ids)
        self._num_live += len(ids)

    def remove_many(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids):
            return
        _, cells = self._probe(self._values[ids], ids)
        if (cells < 0).any():
            raise LogicError("an id removed from the fingerprint index was not in it")
        self._cells[cells] = REMOVED
        self._num_live -= len(ids)
        self._num_removed += len(ids)

    # ---- probing -----------------------------------------------------------------------------
    def _start(self, fingerprints: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Home cells and probe steps (int64: the mask keeps them below 2**63, so a view is exact)."""
        mask = np.uint64(self._mask)
        home = fingerprints & mask
        step = fingerprints >> _32
        step |= _1
        step &= mask
        return home.view(np.int64), step.view(np.int64)

    def _start_one(self, fingerprint: int) -> tuple[int, int]:
        return fingerprint & self._mask, ((fingerprint >> 32) | 1) & self._mask

    def _probe(self, fingerprints: np.ndarray, targets: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """(id, cell) of each fingerprint's first cell holding an id with that fingerprint (or,
        with `targets`, holding exactly `targets[k]`): EMPTY and -1 where none."""
        n = len(fingerprints)
        found = np.full(n, EMPTY, dtype=np.int64)
        where = np.full(n, -1, dtype=np.int64)
        position, step = self._start(fingerprints)
        pending = np.arange(n)
        while len(pending) > _SCALAR_BELOW:
            at = position[pending]
            value = self._cells[at].astype(np.int64)
            hit = value >= 0
            if targets is None:
                hit[hit] = self._values[value[hit]] == fingerprints[pending[hit]]
            else:
                hit &= value == targets[pending]
            found[pending[hit]] = value[hit]
            where[pending[hit]] = at[hit]
            pending = pending[~hit & (value != EMPTY)]
            position[pending] = (position[pending] + step[pending]) & self._mask
        for k in pending.tolist():   # the few long probe sequences, one by one
            found[k], where[k] = self._walk(int(fingerprints[k]), int(position[k]), int(step[k]),
                                            None if targets is None else int(targets[k]))
        return found, where

    def _walk(self, fingerprint: int, at: int, step: int, target: int | None) -> tuple[int, int]:
        cells, values, mask = self._cells, self._values, self._mask
        while True:
            cell = int(cells[at])
            if cell == EMPTY:
                return EMPTY, -1
            if cell >= 0 and (cell == target if target is not None else int(values[cell]) == fingerprint):
                return cell, at
            at = (at + step) & mask

    def _place(self, ids: np.ndarray) -> None:
        """Put each id in the first free cell of its fingerprint's probe sequence."""
        position, step = self._start(self._values[ids])
        pending = np.arange(len(ids))
        while len(pending) > _SCALAR_BELOW:
            at = position[pending]
            before = self._cells[at]
            free = np.flatnonzero(before < 0)
            # Of several ids writing one free cell this round, the last write stays; the rest go on.
            self._cells[at[free]] = ids[pending[free]]
            taken = free[self._cells[at[free]] == ids[pending[free]]]
            self._num_removed -= int((before[taken] == REMOVED).sum())
            placed = np.zeros(len(pending), dtype=bool)
            placed[taken] = True
            pending = pending[~placed]
            position[pending] = (position[pending] + step[pending]) & self._mask
        for k in pending.tolist():
            cell_at = int(position[k])
            while int(self._cells[cell_at]) >= 0:
                cell_at = (cell_at + int(step[k])) & self._mask
            self._num_removed -= int(self._cells[cell_at]) == REMOVED
            self._cells[cell_at] = ids[k]

    def _reserve(self, extra: int) -> None:
        """Rebuild before adding `extra` would load the table past _MAX_LOAD."""
        cells = len(self._cells)
        if self._num_live + self._num_removed + extra <= _MAX_LOAD * cells:
            return
        needed = self._num_live + extra
        while needed > _MAX_LOAD * cells * 0.75:   # room to add a quarter as many again before the next rebuild
            cells *= 2
        live = self.ids()
        self._cells = lazy_zeros(cells, np.int32, EMPTY)
        self._mask = cells - 1
        self._num_removed = 0
        self._place(live)

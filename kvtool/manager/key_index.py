"""Node ids by 256-bit block key: an open-addressing hash table over numpy arrays.

A radix tree of millions of blocks cannot afford a Python dict entry, a bytes object and an int
object a block (about 150 bytes). Here a block costs its 32-byte key and a 4-byte table cell at
load below 1/2, and a whole prompt's keys are looked up or added in a few vectorised passes.

Keys are SHA-256 digests, uniformly random: the first 64-bit word picks the home cell and the
second the (odd) probe step, so probing is double hashing without computing another hash. A
lookup compares all 256 bits of a candidate, so two keys are the same block only when equal.
"""

from __future__ import annotations

import sys

import numpy as np

from kvtool.errors import LogicError
from kvtool.manager.growable import grow_rows

EMPTY = -1
REMOVED = -2
"""Cell values besides a node id: never used, and used once (a probe goes on past it)."""

_SCALAR_BELOW = 8
"""Keys still probing when a vectorised round is not worth its fixed cost."""
_MIN_CELLS = 1 << 10
_MAX_LOAD = 0.5
"""Live plus removed cells above this share of the table: rebuild (grow when live alone is high)."""


def keys_array(digests: list[bytes]) -> np.ndarray:
    """32-byte digests as a (n, 4) uint64 array (one copy)."""
    if not digests:
        return np.zeros((0, 4), dtype=np.uint64)
    return np.frombuffer(b"".join(digests), dtype=np.uint64).reshape(-1, 4)


class KeyIndex:
    """A set of ids (small non-negative ints), each with a 256-bit key; find ids by key.

    Contract: `add_many` takes ids not in the set and keys not in the set; `remove_many` takes
    ids in the set. Ids index `keys`, which grows to the largest id added.
    """

    def __init__(self, expected: int = _MIN_CELLS) -> None:
        """Sized for `expected` ids without a rebuild (key rows are zeroed lazily: unused ones cost nothing)."""
        cells = _MIN_CELLS
        while expected > _MAX_LOAD * cells:
            cells *= 2
        self._cells = np.full(cells, EMPTY, dtype=np.int32)
        self._mask = np.uint64(cells - 1)
        self._keys = np.zeros((max(expected, 16), 4), dtype=np.uint64)
        self._num_live = 0
        self._num_removed = 0

    def __len__(self) -> int:
        return self._num_live

    def key(self, node_id: int) -> bytes:
        return self._keys[node_id].tobytes()

    def find_many(self, keys: np.ndarray) -> np.ndarray:
        """The id of each (n, 4) key, or EMPTY where it is not in the set (int64)."""
        if len(keys) == 1:
            return np.array([self.find(keys[0].tobytes())], dtype=np.int64)
        found, _ = self._probe(keys)
        return found

    def find(self, key: bytes) -> int:
        """The id of one 32-byte key, or EMPTY (one key does not pay a vectorised round's fixed cost)."""
        mask = int(self._mask)
        at = int.from_bytes(key[:8], sys.byteorder) & mask
        return self._walk(key, at, (int.from_bytes(key[8:16], sys.byteorder) | 1) & mask)[0]

    def _walk(self, key: bytes, at: int, step: int) -> tuple[int, int]:
        """(id, cell) of `key`, its probe sequence walked in Python from cell `at` by `step`:
        (EMPTY, -1) when absent."""
        mask, cells, keys = int(self._mask), self._cells, self._keys
        while True:
            cell = int(cells[at])
            if cell == EMPTY:
                return EMPTY, -1
            if cell >= 0 and keys[cell].tobytes() == key:
                return cell, at
            at = (at + step) & mask

    def add_many(self, ids: np.ndarray, keys: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids):
            return
        self._reserve(len(ids))
        if ids.max() >= len(self._keys):
            self._keys = grow_rows(self._keys, int(ids.max()) + 1)
        self._keys[ids] = keys
        self._place(ids, keys)
        self._num_live += len(ids)

    def remove_many(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        if not len(ids):
            return
        _, cells = self._probe(self._keys[ids])
        if (cells < 0).any():
            raise LogicError("a block key removed from the index was not in it")
        self._cells[cells] = REMOVED
        self._num_live -= len(ids)
        self._num_removed += len(ids)

    def ids(self) -> np.ndarray:
        """Every id in the set (table order)."""
        return self._cells[self._cells >= 0].astype(np.int64)

    def id_chunks(self, size: int):
        """`ids()` a chunk of the table at a time (int32)."""
        for start in range(0, len(self._cells), size):
            cells = self._cells[start:start + size]
            yield cells[cells >= 0]

    def keys_of(self, ids: np.ndarray) -> np.ndarray:
        """The (n, 4) keys of these ids."""
        return self._keys[ids]

    # ---- probing -----------------------------------------------------------------------------
    def _start(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return keys[:, 0] & self._mask, (keys[:, 1] | np.uint64(1)) & self._mask

    def _probe(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(id, cell) of each key: the id where found (EMPTY where not) and the cell holding it
        (-1 where not found)."""
        n = len(keys)
        found = np.full(n, EMPTY, dtype=np.int64)
        cells = np.full(n, -1, dtype=np.int64)
        position, step = self._start(keys)
        position = position.astype(np.int64)
        step = step.astype(np.int64)
        mask = int(self._mask)
        pending = np.arange(n)
        while len(pending) > _SCALAR_BELOW:
            at = position[pending]
            value = self._cells[at].astype(np.int64)
            hit = value >= 0
            if hit.any():
                hit[hit] = (self._keys[value[hit]] == keys[pending[hit]]).all(axis=1)
                found[pending[hit]] = value[hit]
                cells[pending[hit]] = at[hit]
            pending = pending[~hit & (value != EMPTY)]
            position[pending] = (position[pending] + step[pending]) & mask
        for k in pending.tolist():   # the few long probe sequences, one by one
            found[k], cells[k] = self._walk(keys[k].tobytes(), int(position[k]), int(step[k]))
        return found, cells

    def _place(self, ids: np.ndarray, keys: np.ndarray) -> None:
        """Put each id in the first free cell of its key's probe sequence (keys not in the table)."""
        position, step = self._start(keys)
        position = position.astype(np.int64)
        step = step.astype(np.int64)
        mask = int(self._mask)
        pending = np.arange(len(ids))
        while len(pending) > _SCALAR_BELOW:
            at = position[pending]
            before = self._cells[at]
            free = np.flatnonzero(before < 0)
            # Of several keys writing one free cell this round, the last write stays; the rest go on.
            self._cells[at[free]] = ids[pending[free]]
            taken = free[self._cells[at[free]] == ids[pending[free]]]
            self._num_removed -= int((before[taken] == REMOVED).sum())
            placed = np.zeros(len(pending), dtype=bool)
            placed[taken] = True
            pending = pending[~placed]
            position[pending] = (position[pending] + step[pending]) & mask
        for k in pending.tolist():   # the few long probe sequences, one by one
            cell_at = int(position[k])
            while int(self._cells[cell_at]) >= 0:
                cell_at = (cell_at + int(step[k])) & mask
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
        self._cells = np.full(cells, EMPTY, dtype=np.int32)
        self._mask = np.uint64(cells - 1)
        self._num_removed = 0
        self._place(live, self._keys[live])

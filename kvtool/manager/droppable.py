"""Droppable pages of one pool group: slots only the radix tree references, kept for reuse and
evicted lowest priority first, least recently released first.

Its node, layer group and priority are the pool group's `PageCells` (shared with the page table:
a slot is in use or droppable, never both); here are only whether it is droppable and the eviction
order, one FIFO of slots per priority. A page taken back into use (`take_many`) stays in its FIFO
but is skipped when reached: each slot's generation counts its releases, and a FIFO entry is live
only while it names the slot's current generation and the slot is still droppable.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtool.errors import OutOfPagesError
from kvtool.manager.growable import grow_rows, lazy_zeros
from kvtool.manager.page_cells import PageCells

_CHECK_CHUNK = 1 << 20


@dataclass
class _Fifo:
    slots: np.ndarray
    generations: np.ndarray
    head: int = 0
    tail: int = 0

    def push(self, slots: np.ndarray, generations: np.ndarray) -> None:
        if self.head > 1024 and self.head * 2 > self.tail:   # reclaim the consumed front
            self.keep(np.ones(self.tail - self.head, dtype=bool))
        end = self.tail + len(slots)
        grow_rows(self.slots, end)
        grow_rows(self.generations, end)
        self.slots[self.tail:end] = slots
        self.generations[self.tail:end] = generations
        self.tail = end


    def keep(self, wanted: np.ndarray) -> None:
        """Keep only the entries from head to tail that `wanted` (a mask over them) marks, in
        order, moved to the front."""
        slots = self.slots[self.head:self.tail][wanted]
        generations = self.generations[self.head:self.tail][wanted]
        self.slots[:len(slots)] = slots
        self.generations[:len(slots)] = generations
        self.head, self.tail = 0, len(slots)


@dataclass(frozen=True)
class Evicted:
    """Pages taken out of the droppable set, in eviction order."""

    slots: np.ndarray
    nodes: np.ndarray
    layer_groups: np.ndarray


class DroppablePages:
    """The droppable slots of one pool group, in eviction order; their other cells are `cells`'."""

    def __init__(self, cells: PageCells) -> None:
        self.num_slots = cells.num_slots
        self.cells = cells
        self.is_droppable = lazy_zeros(cells.num_slots, np.bool_)
        self._generation = lazy_zeros(cells.num_slots, np.uint32)
        self._fifos: dict[int, _Fifo] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, slots: np.ndarray) -> None:
        """Make these distinct slots droppable, released in this order (so evicted in it, per
        priority: their `cells.priority`)."""
        if not len(slots):
            return
        index = np.asarray(slots, dtype=np.int64)
        self.is_droppable[index] = True
        self._generation[index] += np.uint32(1)
        self._count += len(index)
        priorities = self.cells.priority[index]
        mixed = bool((priorities != priorities[0]).any())
        for priority in (np.unique(priorities).tolist() if mixed else [int(priorities[0])]):
            mine = index[priorities == priority] if mixed else index
            fifo = self._fifos.get(priority)
            if fifo is None:
                fifo = self._fifos[priority] = _Fifo(np.zeros(1024, dtype=np.int32), np.zeros(1024, dtype=np.uint32))
            fifo.push(mine, self._generation[mine])
        self._drop_stale_entries()

    def take_many(self, slots: np.ndarray) -> None:
        """These droppable slots (distinct) taken back into use: no longer droppable; their cells stay."""
        self.is_droppable[slots] = False
        self._count -= len(slots)

    def evict(self, count: int) -> Evicted:
        """The `count` first pages in eviction order, no longer droppable; OutOfPagesError (nothing
        taken) when fewer are droppable."""
        if count > self._count:
            raise OutOfPagesError(f"{count} pages to evict, {self._count} droppable")
        taken: list[np.ndarray] = []
        needed = count
        for priority in sorted(self._fifos):
            fifo = self._fifos[priority]
            while needed and fifo.head < fifo.tail:
                window = slice(fifo.head, min(fifo.tail, fifo.head + max(2 * needed, 64)))
                live = self._live(fifo.slots[window], fifo.generations[window])
                ends = np.flatnonzero(live)
                if len(ends) > needed:
                    fifo.head = window.start + int(ends[needed - 1]) + 1
                    live[ends[needed]:] = False
                else:
                    fifo.head = window.stop
                chosen = fifo.slots[window][live].astype(np.int64)
                taken.append(chosen)
                needed -= len(chosen)
            if not needed:
                break
        slots = np.concatenate(taken) if taken else np.zeros(0, dtype=np.int64)
        self.is_droppable[slots] = False
        self._count -= len(slots)
        return Evicted(slots, self.cells.node[slots].astype(np.int64), self.cells.layer_group[slots].astype(np.int64))

    def in_eviction_order(self) -> np.ndarray:
        """Every droppable slot, first to be evicted first."""
        out = []
        for priority in sorted(self._fifos):
            fifo = self._fifos[priority]
            window = slice(fifo.head, fifo.tail)
            out.append(fifo.slots[window][self._live(fifo.slots[window], fifo.generations[window])])
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int32)

    def eviction_list_agrees(self) -> bool:
        """Whether every droppable slot is listed for eviction exactly once, in the FIFO of its
        priority (a chunk at a time: millions of entries are checked in little memory)."""
        seen = np.zeros(self.num_slots, dtype=bool)
        listed = 0
        for priority, fifo in self._fifos.items():
            for start in range(fifo.head, fifo.tail, _CHECK_CHUNK):
                window = slice(start, min(start + _CHECK_CHUNK, fifo.tail))
                slots = fifo.slots[window]
                slots = slots[self._live(slots, fifo.generations[window])]
                if seen[slots].any() or (self.cells.priority[slots] != priority).any():
                    return False
                seen[slots] = True
                if int(seen[slots].sum()) != len(slots):
                    return False
                listed += len(slots)
        return listed == self._count == int(self.is_droppable.sum())

    def droppable_slots(self) -> np.ndarray:
        return np.flatnonzero(self.is_droppable)

    def _live(self, slots: np.ndarray, generations: np.ndarray) -> np.ndarray:
        return self.is_droppable[slots] & (self._generation[slots] == generations)

    def _drop_stale_entries(self) -> None:
        """Keep the FIFOs within 1.25 times the droppable pages: pages taken back into use and released
        again leave an entry each, which eviction alone would never reach when nothing is evicted."""
        entries = sum(f.tail - f.head for f in self._fifos.values())
        if entries <= self._count + self._count // 4 + 4096:
            return
        for fifo in self._fifos.values():
            window = slice(fifo.head, fifo.tail)
            fifo.keep(self._live(fifo.slots[window], fifo.generations[window]))

"""Pages: who uses a slot, and eviction of pages only the radix tree still references.

A page is one block's slot in one layer group. Its status follows from its users:
LOCKED (an active cache uses it), HELD (only suspended caches or an async-save hold),
DROPPABLE (only the tree). A page nobody references is freed at once. Droppable pages are
evicted LRU within priority buckets, lowest priority first (`DroppablePages`).

Pages are named by slot: everything about them is a cell of their pool group's `PageCells`, and
callers pass arrays of slots (a prefill allocates, and a close releases, thousands at once). A
`Page` is only a description by value, for the page callbacks and for inspection.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from kvtool.errors import LogicError, OutOfPagesError
from kvtool.manager.droppable import DroppablePages
from kvtool.manager.page_cells import NO_NODE, PageCells
from kvtool.manager.storage import SlotAllocator
from kvtool.types import LayerGroupId, PageIndex, PageStatus, PoolGroupIndex, Priority

if TYPE_CHECKING:
    from kvtool.manager.radix_tree import RadixTree


class Page(NamedTuple):
    """One page described by value (a snapshot of its cells: it does not follow later changes)."""

    layer_group_id: LayerGroupId
    pool_group_index: PoolGroupIndex
    slot: PageIndex
    node: int
    """The radix tree node holding the page; NO_NODE when none."""
    priority: Priority
    status: PageStatus | None
    """None: the slot is free."""

    def __repr__(self) -> str:
        status = self.status.value if self.status is not None else "free"
        return f"Page(group={self.layer_group_id}, slot={self.slot}, {status})"


def _slots(slots) -> np.ndarray:
    return np.asarray(slots, dtype=np.int64)


class PageTable:
    """Allocation, reference counts and eviction for every pool group.

    Slots passed in one call are distinct (a cache or hold references a page once): their counts
    change with one array operation each.
    """

    def __init__(self, allocators: list[SlotAllocator], pool_group_of: dict[LayerGroupId, PoolGroupIndex],
                 tree: RadixTree) -> None:
        self.allocators = allocators
        self._pool_group_of = pool_group_of
        self._tree = tree
        self._cells = [PageCells(a.num_slots) for a in allocators]
        self._droppable = [DroppablePages(cells) for cells in self._cells]
        self.num_evictions = 0
        self.on_allocate: Callable[[Page], None] | None = None
        self.on_free: Callable[[Page], None] | None = None
        """Called with a page whose slot goes back to the free list (its bytes are nobody's now)."""
        self.on_evict: Callable[[Page, int], None] | None = None
        """Called with the evicted page (its slot already free) and the block ordinal it held."""
        self.keep_reusable = True
        """False: a page only the tree still references is evicted (freed, poisoned) the moment its
        last user lets it go, not kept for reuse (kvtool validate where nothing reuses it)."""

    # ---- reading -----------------------------------------------------------------------------
    def pool_group_of(self, layer_group_id: LayerGroupId) -> PoolGroupIndex:
        return self._pool_group_of[layer_group_id]

    def cells(self, pool_group: PoolGroupIndex) -> PageCells:
        return self._cells[pool_group]

    def num_droppable(self, pool_group: PoolGroupIndex) -> int:
        return len(self._droppable[pool_group])

    def num_available(self, pool_group: PoolGroupIndex) -> int:
        """Slots an allocation could get now: free ones plus evictable ones."""
        return self.allocators[pool_group].num_free + self.num_droppable(pool_group)

    def droppable(self, pool_group: PoolGroupIndex) -> DroppablePages:
        return self._droppable[pool_group]

    def status(self, pool_group: PoolGroupIndex, slot: int) -> PageStatus | None:
        """The page's status; None when the slot is free."""
        cells = self._cells[pool_group]
        if cells.num_active[slot]:
            return PageStatus.LOCKED
        if cells.num_held[slot]:
            return PageStatus.HELD
        if self._droppable[pool_group].is_droppable[slot]:
            return PageStatus.DROPPABLE
        return None

    def page(self, pool_group: PoolGroupIndex, slot: int) -> Page:
        cells = self._cells[pool_group]
        return Page(LayerGroupId(int(cells.layer_group[slot])), pool_group, PageIndex(int(slot)),
                    int(cells.node[slot]), Priority(int(cells.priority[slot])), self.status(pool_group, slot))

    def pages_in_use(self, pool_group: PoolGroupIndex) -> np.ndarray:
        """Slots of the pages some cache or hold uses, ascending."""
        return np.flatnonzero(self._cells[pool_group].in_use_mask())

    def droppable_pages(self, pool_group: PoolGroupIndex) -> list[Page]:
        """Droppable pages in eviction order (lowest priority first, least recently released first)."""
        return [self.page(pool_group, slot) for slot in self._droppable[pool_group].in_eviction_order().tolist()]

    # ---- allocating --------------------------------------------------------------------------
    def allocate(self, layer_group_id: LayerGroupId, active: bool, is_scratch: bool = False) -> int:
        """A new page used once (active or held); evicts a droppable page when no slot is free."""
        pool_group = self._pool_group_of[layer_group_id]
        allocator = self.allocators[pool_group]
        if allocator.num_free == 0:
            self._evict_one(pool_group)
        slot = allocator.allocate()
        self._cells[pool_group].hand_out(slot, layer_group_id, active, is_scratch)
        if self.on_allocate is not None:
            self.on_allocate(self.page(pool_group, slot))
        return slot

    def allocate_many(self, layer_group_id: LayerGroupId, count: int, active: bool) -> np.ndarray:
        """`count` new pages (their slots), exactly what `count` calls of `allocate` would give
        (the same slots, the same evictions in the same order). With a page callback set it is
        those calls."""
        if self._has_callbacks():
            return _slots([self.allocate(layer_group_id, active) for _ in range(count)])
        pool_group = self._pool_group_of[layer_group_id]
        allocator = self.allocators[pool_group]
        shortfall = count - allocator.num_free
        if shortfall > 0:
            self._evict(pool_group, shortfall)
        slots, run = allocator.allocate_run(count)
        self._cells[pool_group].hand_out(slots if run is None else run, layer_group_id, active)
        return slots

    # ---- users -------------------------------------------------------------------------------
    def acquire_tree_pages(self, layer_group_id: LayerGroupId, slots: np.ndarray) -> None:
        """One more held user of each of these pages the tree holds for `layer_group_id` (in use,
        or droppable and so taken back into use): a reused prefix's thousands at once."""
        pool_group = self._pool_group_of[layer_group_id]
        index = _slots(slots)
        droppable = self._droppable[pool_group]
        taken = droppable.is_droppable[index]
        if taken.any():
            droppable.take_many(index[taken])
        self._cells[pool_group].num_held[index] += 1

    def acquire(self, pool_group: PoolGroupIndex, slots: np.ndarray, active: bool) -> None:
        """One more user of each of these pages in use (a hold)."""
        index = _slots(slots)
        cells = self._cells[pool_group]
        if len(index) and (cells.num_users(index) <= 0).any():
            raise LogicError(f"{self.page(pool_group, int(index[cells.num_users(index) <= 0][0]))} "
                             "acquired while not in use")
        (cells.num_active if active else cells.num_held)[index] += 1

    def set_active(self, pool_group: PoolGroupIndex, slots: np.ndarray, active: bool) -> None:
        """Move one user of each page between suspended (HELD) and active (LOCKED)."""
        index = _slots(slots)
        cells = self._cells[pool_group]
        source, target = (cells.num_held, cells.num_active) if active else (cells.num_active, cells.num_held)
        short = source[index] <= 0
        if short.any():
            what = "resumed while not held" if active else "suspended while not active"
            raise LogicError(f"{self.page(pool_group, int(index[short][0]))} {what}")
        source[index] -= 1
        target[index] += 1

    def release(self, pool_group: PoolGroupIndex, slots: np.ndarray, active: bool) -> None:
        """One user fewer of each page, in order; a page left with no user is freed, or becomes
        droppable when in the tree (released later, evicted later). LogicError, with nothing
        changed, when a page has no such user."""
        index = _slots(slots)
        if not len(index):
            return
        cells = self._cells[pool_group]
        counts = cells.num_active if active else cells.num_held
        short = counts[index] <= 0
        if short.any():
            what = "released while not active" if active else "released while not held"
            raise LogicError(f"{self.page(pool_group, int(index[short][0]))} {what}")
        counts[index] -= 1
        unused = index[cells.num_users(index) == 0]
        if not len(unused):
            return
        if self._has_callbacks() or not self.keep_reusable:
            self._let_go_one_by_one(pool_group, unused)
            return
        in_tree = cells.node[unused] != NO_NODE
        self.allocators[pool_group].free_many(unused[~in_tree])
        self._droppable[pool_group].add(unused[in_tree])

    def _let_go_one_by_one(self, pool_group: PoolGroupIndex, unused: np.ndarray) -> None:
        """Pages nobody uses any more, in order: freed, dropped from the tree, or made droppable."""
        cells = self._cells[pool_group]
        kept = []
        for slot in unused.tolist():
            if cells.node[slot] == NO_NODE:
                self._free(pool_group, slot)
            elif not self.keep_reusable:
                self._drop(pool_group, slot)
            else:
                kept.append(slot)
        self._droppable[pool_group].add(_slots(kept))

    def attach(self, layer_group_id: LayerGroupId, slots: np.ndarray, nodes: np.ndarray, priority: Priority) -> None:
        """Let the tree reference these pages as these nodes' pages for their layer group, at
        `priority` once droppable. The caller picks pages in use, held by no node and not scratch,
        for nodes holding no page of the group (`check_manager` finds a page that was not)."""
        cells = self._cells[self._pool_group_of[layer_group_id]]
        index = _slots(slots)
        cells.node[index] = nodes
        cells.priority[index] = priority
        self._tree.pages[_slots(nodes), layer_group_id] = index

    # ---- eviction ----------------------------------------------------------------------------
    def evict_all(self, pool_group: PoolGroupIndex) -> int:
        """Evict every droppable page of `pool_group` (in eviction order); returns how many."""
        count = self.num_droppable(pool_group)
        if not self._has_callbacks():
            self._evict(pool_group, count)
            return count
        for _ in range(count):
            self._evict_one(pool_group)
        return count

    def _has_callbacks(self) -> bool:
        return self.on_allocate is not None or self.on_free is not None or self.on_evict is not None

    def _evict(self, pool_group: PoolGroupIndex, count: int) -> None:
        """`_evict_one` `count` times, without the page callbacks (none is set)."""
        droppable = self._droppable[pool_group]
        short = count > len(droppable)
        evicted = droppable.evict(min(count, len(droppable)))   # as one at a time would: all, then the error
        self._tree.pages[evicted.nodes, evicted.layer_groups] = -1
        self._cells[pool_group].node[evicted.slots] = NO_NODE
        self.allocators[pool_group].free_many(evicted.slots)
        self._tree.prune_many(evicted.nodes)
        self.num_evictions += len(evicted.slots)
        if short:
            raise OutOfPagesError(f"pool group {pool_group}: no free and no evictable slot")

    def _evict_one(self, pool_group: PoolGroupIndex) -> None:
        droppable = self._droppable[pool_group]
        if not len(droppable):
            raise OutOfPagesError(f"pool group {pool_group}: no free and no evictable slot")
        self._drop(pool_group, int(droppable.evict(1).slots[0]))

    def _drop(self, pool_group: PoolGroupIndex, slot: int) -> None:
        """Evict the page in `slot` (in use by nobody, not droppable) from the tree."""
        cells = self._cells[pool_group]
        node, layer_group = int(cells.node[slot]), int(cells.layer_group[slot])
        page = self.page(pool_group, slot)
        self._tree.pages[node, layer_group] = -1
        cells.node[slot] = NO_NODE
        ordinal = self._tree.block_ordinal(node)
        self._free(pool_group, slot)
        self._tree.prune(node)
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(page._replace(status=None), ordinal)

    def _free(self, pool_group: PoolGroupIndex, slot: int) -> None:
        if self.on_free is not None:
            self.on_free(self.page(pool_group, slot))
        self.allocators[pool_group].free(PageIndex(slot))

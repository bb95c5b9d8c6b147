"""Pages: who uses a slot, and eviction of pages only the radix tree still references.

A page is one block's slot in one layer group. Its status follows from its users:
LOCKED (an active cache uses it), HELD (only suspended caches or an async-save hold),
DROPPABLE (only the tree). A page nobody references is freed at once. Droppable pages are
evicted LRU within priority buckets, lowest priority first (`DroppablePages`).

A page in use is a `Page` object, one per slot, shared by its users; a droppable page is no
object, only cells of `DroppablePages` (a trace caches millions). Taken back into use (a prefix
reused from the tree), it gets a new `Page` object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable


import numpy as np

from kvtool.errors import LogicError, OutOfPagesError
from kvtool.manager.droppable import DroppablePages
from kvtool.manager.storage import SlotAllocator
from kvtool.types import DEFAULT_PRIORITY, LayerGroupId, PageIndex, PageStatus, PoolGroupIndex, Priority

if TYPE_CHECKING:
    from kvtool.manager.radix_tree import RadixTree


class Page:
    __slots__ = ("layer_group_id", "pool_group_index", "slot", "num_active", "num_held", "node",
                 "priority", "is_scratch")

    def __init__(self, layer_group_id: LayerGroupId, pool_group_index: PoolGroupIndex, slot: PageIndex,
                 is_scratch: bool) -> None:
        self.layer_group_id = layer_group_id
        self.pool_group_index = pool_group_index
        self.slot = slot
        self.num_active = 0
        self.num_held = 0
        self.node: int | None = None
        """The radix tree node holding this page, if any."""
        self.priority: Priority = DEFAULT_PRIORITY
        self.is_scratch = is_scratch

    @property
    def status(self) -> PageStatus:
        if self.num_active:
            return PageStatus.LOCKED
        if self.num_held:
            return PageStatus.HELD
        return PageStatus.DROPPABLE

    def __repr__(self) -> str:
        return f"Page(group={self.layer_group_id}, slot={self.slot}, {self.status.value})"


class PageTable:
    """Allocation, reference counts and eviction for every pool group."""

    def __init__(self, allocators: list[SlotAllocator], pool_group_of: dict[LayerGroupId, PoolGroupIndex],
                 tree: RadixTree) -> None:
        self.allocators = allocators
        self._pool_group_of = pool_group_of
        self._tree = tree
        self._pages: list[dict[PageIndex, Page]] = [{} for _ in allocators]
        """Pages in use, by slot, per pool group."""
        self._droppable = [DroppablePages(a.num_slots) for a in allocators]
        self.num_evictions = 0
        self.on_allocate: Callable[[Page], None] | None = None
        self.on_free: Callable[[Page], None] | None = None
        """Called with a page whose slot goes back to the free list (its bytes are nobody's now)."""
        self.on_evict: Callable[[Page, int], None] | None = None
        """Called with the evicted page (its slot already free) and the block ordinal it held."""
        self.keep_reusable = True
        """False: a page only the tree still references is evicted (freed, poisoned) the moment its
        last user lets it go, not kept for reuse (kvtool validate where nothing reuses it)."""

    def pool_group_of(self, layer_group_id: LayerGroupId) -> PoolGroupIndex:
        return self._pool_group_of[layer_group_id]

    def num_droppable(self, pool_group: PoolGroupIndex) -> int:
        return len(self._droppable[pool_group])

    def num_available(self, pool_group: PoolGroupIndex) -> int:
        """Slots an allocation could get now: free ones plus evictable ones."""
        return self.allocators[pool_group].num_free + self.num_droppable(pool_group)

    def allocate(self, layer_group_id: LayerGroupId, active: bool, is_scratch: bool = False) -> Page:
        """A new page used once (active or held); evicts a droppable page when no slot is free."""
        pool_group = self._pool_group_of[layer_group_id]
        allocator = self.allocators[pool_group]
        if allocator.num_free == 0:
            self._evict_one(pool_group)
        page = Page(layer_group_id, pool_group, allocator.allocate(), is_scratch)
        self._pages[pool_group][page.slot] = page
        if self.on_allocate is not None:
            self.on_allocate(page)
        self._add_user(page, active)
        return page

    def allocate_many(self, layer_group_id: LayerGroupId, count: int, active: bool) -> list[Page]:
        """`count` new pages, exactly what `count` calls of `allocate` would give (the same slots,
        the same evictions in the same order), at a fraction of the cost: a long prefill
        allocates thousands of pages in one resize. With a page callback set it is those calls."""
        if self.on_allocate is not None or self.on_free is not None or self.on_evict is not None:
            return [self.allocate(layer_group_id, active) for _ in range(count)]
        pool_group = self._pool_group_of[layer_group_id]
        allocator = self.allocators[pool_group]
        shortfall = count - allocator.num_free
        if shortfall > 0:
            self._evict(pool_group, shortfall)
        table = self._pages[pool_group]
        pages = []
        for slot in allocator.allocate_many(count):
            page = Page(layer_group_id, pool_group, slot, False)
            if active:
                page.num_active = 1
            else:
                page.num_held = 1
            table[slot] = page
            pages.append(page)
        return pages

    def acquire_tree_pages(self, layer_group_id: LayerGroupId, slots: list[int]) -> list[Page]:
        """The pages in these slots (distinct) that the tree holds for `layer_group_id`, each with
        one more held user: their objects when in use, else new ones, taken out of the droppable
        set at once (a reused prefix's thousands of pages)."""
        pool_group = self._pool_group_of[layer_group_id]
        table, droppable = self._pages[pool_group], self._droppable[pool_group]
        index = np.array(slots, dtype=np.int64)
        taken = droppable.is_droppable[index]
        revived = iter(droppable.take_many(index[taken]))
        pages = []
        for slot, was_droppable in zip(slots, taken.tolist()):
            if was_droppable:
                node, priority = next(revived)
                page = table[PageIndex(slot)] = Page(layer_group_id, pool_group, PageIndex(slot), False)
                page.node, page.priority = node, priority
            else:
                page = table[PageIndex(slot)]
            page.num_held += 1
            pages.append(page)
        return pages

    def acquire(self, page: Page, active: bool) -> None:
        """One more user of a page in use (a reuse from the tree, or a hold)."""
        self._add_user(page, active)

    def release(self, page: Page, active: bool) -> None:
        """One user fewer; a page left with no user is freed, or becomes droppable when in the tree."""
        self.release_many((page,), active)

    def release_many(self, pages: Iterable[Page], active: bool) -> None:
        """`release` of each page, in order (one call for a closing cache's thousands)."""
        kept: list[Page] = []
        for page in pages:
            if active:
                if page.num_active <= 0:
                    raise LogicError(f"{page} released while not active")
                page.num_active -= 1
            else:
                if page.num_held <= 0:
                    raise LogicError(f"{page} released while not held")
                page.num_held -= 1
            if page.num_active or page.num_held:
                continue
            if page.node is None:
                self._free(page)
            elif not self.keep_reusable:
                self._drop(page)
            else:
                kept.append(page)
        if kept:
            self._make_droppable(kept)

    def _make_droppable(self, pages: list[Page]) -> None:
        by_pool_group: dict[PoolGroupIndex, tuple[list, list, list, list]] = {}
        for page in pages:
            pool_group = page.pool_group_index
            columns = by_pool_group.get(pool_group)
            if columns is None:
                columns = by_pool_group[pool_group] = ([], [], [], [])
            del self._pages[pool_group][page.slot]
            columns[0].append(page.slot)
            columns[1].append(page.node)
            columns[2].append(page.layer_group_id)
            columns[3].append(page.priority)
        for pool_group, (slots, nodes, groups, priorities) in by_pool_group.items():
            self._droppable[pool_group].add(slots, nodes, groups, priorities)

    def set_active(self, page: Page, active: bool) -> None:
        """Move one user between suspended (HELD) and active (LOCKED)."""
        if active:
            if page.num_held <= 0:
                raise LogicError(f"{page} resumed while not held")
            page.num_held -= 1
            page.num_active += 1
        else:
            if page.num_active <= 0:
                raise LogicError(f"{page} suspended while not active")
            page.num_active -= 1
            page.num_held += 1

    def attach(self, page: Page, node: int) -> None:
        """Let the tree reference `page` as `node`'s page for its layer group."""
        if page.node is not None or page.is_scratch:
            raise LogicError(f"{page} cannot join the tree")
        page.node = node
        self._tree.pages[node, page.layer_group_id] = page.slot

    def pages_of(self, pool_group: PoolGroupIndex) -> dict[PageIndex, Page]:
        """Pages in use, by slot (droppable ones are `droppable_pages`)."""
        return self._pages[pool_group]

    def droppable(self, pool_group: PoolGroupIndex) -> DroppablePages:
        return self._droppable[pool_group]

    def droppable_pages(self, pool_group: PoolGroupIndex) -> list[Page]:
        """Droppable pages in eviction order (lowest priority first, least recently released
        first), as new objects describing them."""
        droppable = self._droppable[pool_group]
        pages = []
        for slot in droppable.in_eviction_order().tolist():
            page = Page(LayerGroupId(int(droppable.layer_group[slot])), pool_group, PageIndex(slot), False)
            page.node, page.priority = int(droppable.node[slot]), Priority(int(droppable.priority[slot]))
            pages.append(page)
        return pages

    def _add_user(self, page: Page, active: bool) -> None:
        if active:
            page.num_active += 1
        else:
            page.num_held += 1

    def evict_all(self, pool_group: PoolGroupIndex) -> int:
        """Evict every droppable page of `pool_group` (in eviction order); returns how many."""
        count = self.num_droppable(pool_group)
        if self.on_evict is None and self.on_free is None:
            self._evict(pool_group, count)
            return count
        for _ in range(count):
            self._evict_one(pool_group)
        return count

    def _evict(self, pool_group: PoolGroupIndex, count: int) -> None:
        """`_evict_one` `count` times, without the page callbacks (none is set)."""
        droppable = self._droppable[pool_group]
        short = count > len(droppable)
        evicted = droppable.evict(min(count, len(droppable)))   # as one at a time would: all, then the error
        self._tree.pages[evicted.nodes, evicted.layer_groups] = -1
        self.allocators[pool_group].free_many(evicted.slots)
        self._tree.prune_many(evicted.nodes)
        self.num_evictions += len(evicted.slots)
        if short:
            raise OutOfPagesError(f"pool group {pool_group}: no free and no evictable slot")

    def _evict_one(self, pool_group: PoolGroupIndex) -> None:
        droppable = self._droppable[pool_group]
        if not len(droppable):
            raise OutOfPagesError(f"pool group {pool_group}: no free and no evictable slot")
        evicted = droppable.evict(1)
        slot, node, group = int(evicted.slots[0]), int(evicted.nodes[0]), int(evicted.layer_groups[0])
        page = Page(LayerGroupId(group), pool_group, PageIndex(slot), False)
        page.node, page.priority = node, Priority(int(droppable.priority[slot]))
        self._pages[pool_group][page.slot] = page   # _drop frees it as a page in use
        self._drop(page)

    def _drop(self, page: Page) -> None:
        """Evict `page` (in use by nobody, not droppable) from the tree."""
        node = page.node
        assert node is not None
        self._tree.pages[node, page.layer_group_id] = -1
        page.node = None
        ordinal = self._tree.block_ordinal(node)
        self._free(page)
        self._tree.prune(node)
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(page, ordinal)

    def _free(self, page: Page) -> None:
        if self.on_free is not None:
            self.on_free(page)
        del self._pages[page.pool_group_index][page.slot]
        self.allocators[page.pool_group_index].free(page.slot)

"""`check_manager(manager)`: the manager's invariants, checked from scratch.

- pages are conserved per pool group: free + cached (droppable) + in use == total;
- no slot is owned twice, every owned slot has exactly one page object, free slots are not owned;
- every page's reference counts equal what live caches and holds actually reference;
- tree and pages agree (a node's page points back at the node), partial blocks are leaves;
- region invariants of the layout, and each cache's own invariant.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from kvtool.errors import LogicError
from kvtool.manager.layout import check_layout
from kvtool.manager.pages import Page
from kvtool.types import KvCacheStatus, PageStatus, PoolGroupIndex

if TYPE_CHECKING:
    from kvtool.manager.manager import KvCacheManager


def check_manager(manager: KvCacheManager) -> None:
    expected = {g.layer_group_id: {b for c in g.coalesced for b in c.buffer_ids} for g in manager.layer_groups}
    check_layout(manager.layout, expected)
    for cache in manager.caches:
        cache.check_invariant()
    active, held = _recount(manager)
    for pg in manager.pool_groups:
        _check_pool_group(manager, pg.pool_group_index, active, held)
    _check_tree(manager)


def _recount(manager: KvCacheManager) -> tuple[Counter, Counter]:
    active: Counter = Counter()
    held: Counter = Counter()
    for cache in manager.caches:
        pages = [p for g in manager.layer_groups for p in cache.pages(g.layer_group_id) if p is not None]
        pages += cache.scratch_pages()
        if len({id(p) for p in pages}) != len(pages):
            raise LogicError(f"cache {cache.id} references one page twice")
        counter = active if cache.status is KvCacheStatus.ACTIVE else held
        for page in pages:
            _require_listed(manager, page, f"cache {cache.id}")
            counter[id(page)] += 1
    for hold in manager.holds:
        for page in hold.pages:
            _require_listed(manager, page, "an async-save hold")
            held[id(page)] += 1
    return active, held


def _require_listed(manager: KvCacheManager, page: Page, user: object) -> None:
    """`user` (a description, or the node holding the page) is put into words only on failure:
    a tree of millions of nodes is checked without formatting each."""
    if manager.page_table.pages_of(page.pool_group_index).get(page.slot) is not page:
        raise LogicError(f"{user} uses {page}, whose slot is not owned by that page")


def _check_pool_group(manager: KvCacheManager, pg: PoolGroupIndex, active: Counter, held: Counter) -> None:
    allocator = manager.page_table.allocators[pg]
    pages = manager.page_table.pages_of(pg)
    free = allocator.free_slot_array()
    # Slot sets as masks over the pool: a pool of millions of slots is checked without a set of them.
    if len(free) and (free.min() < 0 or free.max() >= allocator.num_slots or
                      np.bincount(free, minlength=allocator.num_slots).max() > 1):
        raise LogicError(f"pool group {pg}: a slot is in the free list twice")
    with_page = _mask(pages, allocator.num_slots)
    if with_page is None or with_page[free].any() or not np.array_equal(allocator.owned_mask(), with_page):
        raise LogicError(f"pool group {pg}: owned slots and page objects disagree")
    droppable = manager.page_table.droppable_pages(pg)
    listed = set(droppable)   # a page's hash is its identity
    if len(listed) != len(droppable):
        raise LogicError(f"pool group {pg}: a page is listed for eviction twice")
    in_use = 0
    for page in pages.values():   # no status property, no Counter default: millions of pages
        key = id(page)
        if page.num_active or page.num_held:
            in_use += 1
            if (page.num_active, page.num_held) != (active.get(key, 0), held.get(key, 0)) or page in listed:
                _page_error(page, active, held)
        elif key in active or key in held or page.node is None or page not in listed:
            _page_error(page, active, held)
    if len(free) + len(droppable) + in_use != allocator.num_slots:
        raise LogicError(f"pool group {pg}: free {len(free)} + cached {len(droppable)} + in use {in_use} "
                         f"!= total {allocator.num_slots}")


def _mask(slots, num_slots: int) -> np.ndarray | None:
    """`slots` as a boolean mask over [0, num_slots); None when one lies outside."""
    index = np.fromiter(slots, dtype=np.int64, count=len(slots))
    if len(index) and (index.min() < 0 or index.max() >= num_slots):
        return None
    mask = np.zeros(num_slots, dtype=bool)
    mask[index] = True
    return mask


def _page_error(page: Page, active: Counter, held: Counter) -> None:
    """Raise what is wrong with `page` (found wrong by the fast test)."""
    key = id(page)
    if (page.num_active, page.num_held) != (active[key], held[key]):
        raise LogicError(f"{page}: counts (active {page.num_active}, held {page.num_held}) but caches and "
                         f"holds reference it (active {active[key]}, held {held[key]})")
    if page.status is PageStatus.DROPPABLE and page.node is None:
        raise LogicError(f"{page} is referenced by nobody and was not freed")
    raise LogicError(f"{page}: eviction list and status disagree")


def _check_tree(manager: KvCacheManager) -> None:
    """Every page a node holds points back at it and owns its slot; and as many pages point at a
    node as nodes hold (so the two sets are one: no page points at a node that does not hold it)."""
    tables = {pg.pool_group_index: manager.page_table.pages_of(pg.pool_group_index) for pg in manager.pool_groups}
    held_by_nodes = 0
    for node in manager.tree.nodes():
        if not node.is_full and node.children:
            raise LogicError(f"{node}: a partial block has children")
        for group_id, page in node.pages.items():
            if page.node is not node or page.layer_group_id != group_id or page.is_scratch:
                raise LogicError(f"{node} and {page} disagree about each other")
            if tables[page.pool_group_index].get(page.slot) is not page:
                raise LogicError(f"{node} uses {page}, whose slot is not owned by that page")
            held_by_nodes += 1
    pointing = sum(page.node is not None for table in tables.values() for page in table.values())
    if pointing != held_by_nodes:
        for table in tables.values():
            for page in table.values():
                if page.node is not None and page.node.pages.get(page.layer_group_id) is not page:
                    raise LogicError(f"{page} points at a node that does not hold it")
        raise LogicError(f"{pointing} pages point at a node, {held_by_nodes} are held by the tree's nodes")

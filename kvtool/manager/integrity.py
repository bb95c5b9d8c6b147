"""`check_manager(manager)`: the manager's invariants, checked from scratch.

- pages are conserved per pool group: free + cached (droppable) + in use == total;
- no slot is owned twice; an owned slot is a page in use (one object) or droppable, never both;
  free slots are neither;
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
from kvtool.types import KvCacheStatus, PoolGroupIndex

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
    droppable = manager.page_table.droppable(pg)
    # Slot sets as masks over the pool: a pool of millions of slots is checked without a set of
    # them, or an int64 array of them (the never-used tail of the free list is a range).
    free = np.zeros(allocator.num_slots, dtype=bool)
    never_used, freed = allocator.free_slot_parts()
    free[never_used.start:never_used.stop] = True
    if len(freed) and (freed.min() < 0 or freed.max() >= allocator.num_slots or free[freed].any() or
                       len(np.unique(freed)) != len(freed)):
        raise LogicError(f"pool group {pg}: a slot is in the free list twice")
    free[freed] = True
    num_free = int(free.sum())
    in_use = _mask(pages, allocator.num_slots)
    cached = droppable.is_droppable
    if in_use is None or (in_use & free).any() or (in_use & cached).any() or (cached & free).any() or \
            not np.array_equal(allocator.owned_mask(), in_use | cached):
        raise LogicError(f"pool group {pg}: owned slots and page objects disagree")
    if not droppable.eviction_list_agrees():
        raise LogicError(f"pool group {pg}: eviction list and status disagree")
    for page in pages.values():   # no status property, no Counter default: millions of pages
        key = id(page)
        if (page.num_active, page.num_held) != (active.get(key, 0), held.get(key, 0)):
            _page_error(page, active, held)
        if not (page.num_active or page.num_held):
            _page_error(page, active, held)
    if num_free + len(droppable) + len(pages) != allocator.num_slots:
        raise LogicError(f"pool group {pg}: free {num_free} + cached {len(droppable)} + in use {len(pages)} "
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
    raise LogicError(f"{page} is referenced by nobody and was neither freed nor made droppable")


def _check_tree(manager: KvCacheManager) -> None:
    """Every page slot a node holds is a page of that layer group that points back at the node
    (in use, or droppable), and every page pointing at a node is held by it; partial blocks are
    leaves. Nodes are checked a chunk at a time: a tree of millions is checked in little memory."""
    tree, table = manager.tree, manager.page_table
    problem = tree.structure_problem()
    if problem:
        raise LogicError(f"radix tree: {problem}")
    held_by_nodes = sum(_check_nodes(manager, nodes) for nodes in tree.node_id_chunks(_CHUNK))
    pointing = sum(len(table.droppable(pg.pool_group_index)) +
                   sum(page.node is not None for page in table.pages_of(pg.pool_group_index).values())
                   for pg in manager.pool_groups)
    if pointing != held_by_nodes:
        for pg in manager.pool_groups:
            for page in table.pages_of(pg.pool_group_index).values():
                if page.node is not None and (not tree.is_alive(page.node) or
                                              tree.pages[page.node, page.layer_group_id] != page.slot):
                    raise LogicError(f"{page} points at a node that does not hold it")
            droppable = table.droppable(pg.pool_group_index)
            for slot in droppable.droppable_slots().tolist():
                node, gid = int(droppable.node[slot]), int(droppable.layer_group[slot])
                if not tree.is_alive(node) or tree.pages[node, gid] != slot:
                    raise LogicError(f"droppable slot {slot} points at a node that does not hold it")
        raise LogicError(f"{pointing} pages point at a node, {held_by_nodes} are held by the tree's nodes")


_CHUNK = 1 << 19


def _check_nodes(manager: KvCacheManager, nodes: np.ndarray) -> int:
    """Check these nodes' pages; returns how many (node, layer group) pages they hold."""
    tree, table = manager.tree, manager.page_table
    if ((tree.num_tokens[nodes] < tree.tokens_per_block) & (tree.num_children[nodes] > 0)).any():
        raise LogicError("a partial block has children")
    held = 0
    for layer_group in manager.layer_groups:
        gid = layer_group.layer_group_id
        droppable, in_use = table.droppable(table.pool_group_of(gid)), table.pages_of(table.pool_group_of(gid))
        slots = tree.pages[nodes, gid]
        holding = slots >= 0
        held += int(holding.sum())
        owners, slots = nodes[holding], slots[holding]
        if len(slots) and slots.max() >= droppable.num_slots:
            raise LogicError(f"{tree.describe(int(owners[slots.argmax()]))} holds slot {int(slots.max())}, outside its pool")
        listed = droppable.is_droppable[slots]
        wrong = listed.copy()
        wrong[listed] = (droppable.node[slots[listed]] != owners[listed]) | \
            (droppable.layer_group[slots[listed]] != gid)
        for node, slot in zip(owners[~listed].tolist(), slots[~listed].tolist()):   # pages in use: few
            page = in_use.get(slot)
            if page is None:
                raise LogicError(f"{tree.describe(node)} holds slot {slot}, which no page of its layer group owns")
            if page.node != node or page.layer_group_id != gid or page.is_scratch:
                raise LogicError(f"{tree.describe(node)} and {page} disagree about each other")
        if wrong.any():
            node, slot = int(owners[wrong][0]), int(slots[wrong][0])
            raise LogicError(f"{tree.describe(node)} holds slot {slot}, which no page of its layer group owns")
    return held

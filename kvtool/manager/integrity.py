"""`check_manager(manager)`: the manager's invariants, checked from scratch.

- pages are conserved per pool group: free + cached (droppable) + in use == total;
- no slot is owned twice; an owned slot is a page in use (a count above zero) or droppable, never
  both; free slots are neither;
- every page's reference counts equal what live caches and holds actually reference;
- tree and pages agree (a node's page points back at the node), partial blocks are leaves;
- region invariants of the layout, and each cache's own invariant.

Everything is array operations over slots, a chunk of nodes at a time: a tree of millions of
nodes and pages is checked in little memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kvtool.errors import LogicError
from kvtool.manager.layout import check_layout
from kvtool.manager.page_cells import NO_NODE
from kvtool.types import BAD_PAGE_INDEX, KvCacheStatus, PoolGroupIndex

if TYPE_CHECKING:
    from kvtool.manager.manager import KvCacheManager


def check_manager(manager: KvCacheManager) -> None:
    expected = {g.layer_group_id: {b for c in g.coalesced for b in c.buffer_ids} for g in manager.layer_groups}
    check_layout(manager.layout, expected)
    for cache in manager.caches:
        cache.check_invariant()
    referenced = _referenced(manager)
    for pg in manager.pool_groups:
        index = pg.pool_group_index
        _check_pool_group(manager, index, *referenced.get(index, (_NONE, _NONE)))
    _check_tree(manager)


_NONE = np.zeros(0, dtype=np.int64)


def _referenced(manager: KvCacheManager) -> dict[PoolGroupIndex, tuple[np.ndarray, np.ndarray]]:
    """Per pool group: the slots active caches reference, and those suspended caches and holds
    hold (a slot once per user)."""
    active: dict[PoolGroupIndex, list[np.ndarray]] = {}
    held: dict[PoolGroupIndex, list[np.ndarray]] = {}
    table = manager.page_table
    for cache in manager.caches:
        users = active if cache.status is KvCacheStatus.ACTIVE else held
        mine: dict[PoolGroupIndex, list[np.ndarray]] = {}
        for group in manager.layer_groups:
            gid = group.layer_group_id
            pages = cache.page_slots(gid)
            mine.setdefault(table.pool_group_of(gid), []).extend(
                [pages[pages != BAD_PAGE_INDEX], np.array(cache.scratch_slots(gid), dtype=np.int64)])
        for pg, parts in mine.items():
            slots = np.concatenate(parts)
            if len(np.unique(slots)) != len(slots):
                raise LogicError(f"cache {cache.id} references one page twice")
            users.setdefault(pg, []).append(slots)
    for hold in manager.holds:
        for pg, slots in hold.slots.items():
            held.setdefault(pg, []).append(slots)
    return {pg: (np.concatenate(active.get(pg, [_NONE])), np.concatenate(held.get(pg, [_NONE])))
            for pg in set(active) | set(held)}


def _check_pool_group(manager: KvCacheManager, pg: PoolGroupIndex, active: np.ndarray, held: np.ndarray) -> None:
    table = manager.page_table
    allocator, cells, droppable = table.allocators[pg], table.cells(pg), table.droppable(pg)
    for slots in (active, held):
        if len(slots) and (slots.min() < 0 or slots.max() >= allocator.num_slots):
            raise LogicError(f"pool group {pg}: a cache or hold uses a slot outside the pool")
    # Slot sets as masks over the pool: a pool of millions of slots is checked without a set of
    # them, or an int64 array of them (the never-used tail of the free list is a range).
    free = np.zeros(allocator.num_slots, dtype=bool)
    never_used, freed = allocator.free_slot_parts()
    free[never_used.start:never_used.stop] = True
    if len(freed) and (freed.min() < 0 or freed.max() >= allocator.num_slots or free[freed].any() or
                       len(np.unique(freed)) != len(freed)):
        raise LogicError(f"pool group {pg}: a slot is in the free list twice")
    free[freed] = True
    if (cells.num_active < 0).any() or (cells.num_held < 0).any():
        raise LogicError(f"pool group {pg}: a page has a negative count")
    in_use = cells.in_use_mask()
    cached = droppable.is_droppable
    if (in_use & free).any() or (in_use & cached).any() or (cached & free).any() or \
            not np.array_equal(allocator.owned_mask(), in_use | cached):
        raise LogicError(f"pool group {pg}: owned slots and page cells disagree")
    if not droppable.eviction_list_agrees():
        raise LogicError(f"pool group {pg}: eviction list and status disagree")
    _check_counts(manager, pg, in_use, active, held)
    if (cells.is_scratch & in_use & (cells.node != NO_NODE)).any():
        raise LogicError(f"pool group {pg}: a scratch page is in the tree")
    num_in_use = int(in_use.sum())
    if int(free.sum()) + len(droppable) + num_in_use != allocator.num_slots:
        raise LogicError(f"pool group {pg}: free {int(free.sum())} + cached {len(droppable)} + in use {num_in_use} "
                         f"!= total {allocator.num_slots}")


def _check_counts(manager: KvCacheManager, pg: PoolGroupIndex, in_use: np.ndarray, active: np.ndarray,
                  held: np.ndarray) -> None:
    """Each page's counts are the users referencing it, and a page in use has some."""
    cells = manager.page_table.cells(pg)
    used, counts = np.unique(np.concatenate((active, held)), return_counts=True)
    num_active = np.zeros(len(used), dtype=np.int64)
    np.add.at(num_active, np.searchsorted(used, active), 1)
    num_held = counts - num_active
    wrong = (cells.num_active[used] != num_active) | (cells.num_held[used] != num_held)
    if wrong.any():
        at = int(np.flatnonzero(wrong)[0])
        page = manager.page_table.page(pg, int(used[at]))
        raise LogicError(f"{page}: counts (active {int(cells.num_active[used[at]])}, held "
                         f"{int(cells.num_held[used[at]])}) but caches and holds reference it (active "
                         f"{int(num_active[at])}, held {int(num_held[at])})")
    unreferenced = in_use.copy()
    unreferenced[used] = False
    if unreferenced.any():
        slot = int(np.flatnonzero(unreferenced)[0])
        page = manager.page_table.page(pg, slot)
        raise LogicError(f"{page}: counts (active {int(cells.num_active[slot])}, held {int(cells.num_held[slot])}) "
                         "but caches and holds reference it (active 0, held 0)")


def _check_tree(manager: KvCacheManager) -> None:
    """Every page slot a node holds is an owned page of that layer group that points back at the
    node, and every owned page pointing at a node is held by it; partial blocks are leaves."""
    tree, table = manager.tree, manager.page_table
    problem = tree.structure_problem()
    if problem:
        raise LogicError(f"radix tree: {problem}")
    held_by_nodes = sum(_check_nodes(manager, nodes) for nodes in tree.node_id_chunks(_CHUNK))
    pointing = 0
    for pg in manager.pool_groups:
        index = pg.pool_group_index
        cells = table.cells(index)
        owned = cells.in_use_mask() | table.droppable(index).is_droppable
        pointing += int((owned & (cells.node != NO_NODE)).sum())
    if pointing != held_by_nodes:
        for pg in manager.pool_groups:
            _name_a_page_pointing_elsewhere(manager, pg.pool_group_index)
        raise LogicError(f"{pointing} pages point at a node, {held_by_nodes} are held by the tree's nodes")


def _name_a_page_pointing_elsewhere(manager: KvCacheManager, pg: PoolGroupIndex) -> None:
    tree, table = manager.tree, manager.page_table
    cells = table.cells(pg)
    owned = cells.in_use_mask() | table.droppable(pg).is_droppable
    for slot in np.flatnonzero(owned & (cells.node != NO_NODE)).tolist():
        node, gid = int(cells.node[slot]), int(cells.layer_group[slot])
        if not tree.is_alive(node) or tree.pages[node, gid] != slot:
            raise LogicError(f"{table.page(pg, slot)} points at a node that does not hold it")


_CHUNK = 1 << 19


def _check_nodes(manager: KvCacheManager, nodes: np.ndarray) -> int:
    """Check these nodes' pages; returns how many (node, layer group) pages they hold."""
    tree, table = manager.tree, manager.page_table
    if ((tree.num_tokens[nodes] < tree.tokens_per_block) & (tree.num_children[nodes] > 0)).any():
        raise LogicError("a partial block has children")
    held = 0
    for layer_group in manager.layer_groups:
        gid = layer_group.layer_group_id
        pg = table.pool_group_of(gid)
        cells, droppable = table.cells(pg), table.droppable(pg)
        slots = tree.pages[nodes, gid]
        holding = slots >= 0
        held += int(holding.sum())
        owners, slots = nodes[holding], slots[holding]
        if len(slots) and slots.max() >= cells.num_slots:
            raise LogicError(f"{tree.describe(int(owners[slots.argmax()]))} holds slot {int(slots.max())}, "
                             "outside its pool")
        in_use = (cells.num_active[slots] != 0) | (cells.num_held[slots] != 0)
        ours = (in_use | droppable.is_droppable[slots]) & (cells.layer_group[slots] == gid) & ~cells.is_scratch[slots]
        if not ours.all():
            node, slot = int(owners[~ours][0]), int(slots[~ours][0])
            raise LogicError(f"{tree.describe(node)} holds slot {slot}, which no page of its layer group owns")
        elsewhere = cells.node[slots] != owners
        if elsewhere.any():
            node, slot = int(owners[elsewhere][0]), int(slots[elsewhere][0])
            if in_use[elsewhere][0]:
                raise LogicError(f"{tree.describe(node)} and {table.page(pg, slot)} disagree about each other")
            raise LogicError(f"{tree.describe(node)} holds slot {slot}, which no page of its layer group owns")
    return held

"""The page table's cells by slot against a plain Python model of pages: a dict of counts, node
and priority per page, a FIFO free list, and an OrderedDict of droppable pages per priority.

Hypothesis drives both through allocations (which evict when no slot is free), reuses of pages
the tree holds, releases, suspends and resumes, and pages joining the tree; after every step each
slot's status and counts, the free list, the eviction order and the eviction count must agree,
with and without page callbacks (the one-page-at-a-time path)."""

from __future__ import annotations

from collections import OrderedDict, deque

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.errors import OutOfPagesError
from kvtool.manager.page_cells import NO_NODE
from kvtool.manager.pages import PageTable
from kvtool.manager.storage import SlotAllocator
from kvtool.types import LayerGroupId, PageStatus, PoolGroupIndex

NUM_SLOTS = 12
PG = PoolGroupIndex(0)
GROUP = LayerGroupId(0)


class StubTree:
    """What the page table touches of the tree: the page cells per node, pruning (a no-op)."""

    def __init__(self) -> None:
        self.pages = np.full((512, 1), -1, dtype=np.int32)

    def prune_many(self, nodes) -> None:
        pass

    def prune(self, node) -> None:
        pass

    def block_ordinal(self, node: int) -> int:
        return 0


class Model:
    def __init__(self) -> None:
        self.free = deque(range(NUM_SLOTS))
        self.pages: dict[int, list] = {}
        """slot -> [active, held, node, priority]"""
        self.droppable: dict[int, OrderedDict] = {}
        self.evictions = 0

    def allocate(self, count: int, active: bool) -> list[int]:
        available = len(self.free) + sum(len(d) for d in self.droppable.values())
        if count > available:
            raise OutOfPagesError("short")
        slots = []
        for _ in range(count):
            if not self.free:
                bucket = self.droppable[min(p for p, d in self.droppable.items() if d)]
                slot, _ = bucket.popitem(last=False)
                del self.pages[slot]
                self.free.append(slot)
                self.evictions += 1
            slot = self.free.popleft()
            self.pages[slot] = [int(active), int(not active), NO_NODE, 0]
            slots.append(slot)
        return slots

    def reuse(self, slots: list[int]) -> None:
        for slot in slots:
            for bucket in self.droppable.values():
                bucket.pop(slot, None)
            self.pages[slot][1] += 1

    def release(self, slots: list[int], active: bool) -> None:
        for slot in slots:
            page = self.pages[slot]
            page[0 if active else 1] -= 1
            if page[0] or page[1]:
                continue
            if page[2] == NO_NODE:
                del self.pages[slot]
                self.free.append(slot)
            else:
                self.droppable.setdefault(page[3], OrderedDict())[slot] = None

    def set_active(self, slots: list[int], active: bool) -> None:
        for slot in slots:
            page = self.pages[slot]
            page[0], page[1] = (page[0] + 1, page[1] - 1) if active else (page[0] - 1, page[1] + 1)

    def status(self, slot: int) -> PageStatus | None:
        page = self.pages.get(slot)
        if page is None:
            return None
        if page[0]:
            return PageStatus.LOCKED
        return PageStatus.HELD if page[1] else PageStatus.DROPPABLE


operation = st.tuples(st.sampled_from(["allocate", "reuse", "release", "suspend", "resume", "attach"]),
                      st.integers(0, 5), st.booleans(), st.integers(0, 2))


@settings(max_examples=150, deadline=None)
@given(st.lists(operation, min_size=1, max_size=40), st.booleans())
def test_the_cells_agree_with_a_model_of_pages(operations, callbacks):
    table = PageTable([SlotAllocator(NUM_SLOTS)], {GROUP: PG}, StubTree())
    if callbacks:
        table.on_free = lambda page: None
    model, next_node = Model(), 0
    for op, count, active, priority in operations:
        in_use = sorted(s for s, p in model.pages.items() if p[0] or p[1])
        if op == "allocate":
            try:
                expected = model.allocate(count, active)
            except OutOfPagesError:
                with pytest.raises(OutOfPagesError):
                    table.allocate_many(GROUP, count, active)
                break   # the batched path evicts what it can first, as one at a time would
            assert table.allocate_many(GROUP, count, active).tolist() == expected
        elif op == "reuse":   # pages the tree holds, in use or droppable: one more held user
            held = [s for s, p in model.pages.items() if p[2] != NO_NODE][:count]
            model.reuse(held)
            table.acquire_tree_pages(GROUP, np.array(held, dtype=np.int64))
        elif op in ("release", "suspend", "resume"):
            index = 0 if op == "suspend" or (op == "release" and active) else 1
            chosen = [s for s in in_use if model.pages[s][index] > 0][:count]
            if op == "release":
                model.release(chosen, index == 0)
                table.release(PG, np.array(chosen, dtype=np.int64), index == 0)
            else:
                model.set_active(chosen, op == "resume")
                table.set_active(PG, np.array(chosen, dtype=np.int64), op == "resume")
        else:   # pages in use and in no node join the tree at `priority`
            chosen = [s for s in in_use if model.pages[s][2] == NO_NODE][:count]
            nodes = list(range(next_node, next_node + len(chosen)))
            next_node += len(chosen)
            for slot, node in zip(chosen, nodes, strict=True):
                model.pages[slot][2:] = [node, priority]
            table.attach(GROUP, np.array(chosen, dtype=np.int64), np.array(nodes, dtype=np.int64), priority)
        cells = table.cells(PG)
        for slot in range(NUM_SLOTS):
            assert table.status(PG, slot) == model.status(slot)
            if slot in model.pages:
                page = model.pages[slot]
                assert (int(cells.num_active[slot]), int(cells.num_held[slot]), int(cells.node[slot])) == \
                    (page[0], page[1], page[2])
        assert table.allocators[0].free_slots() == list(model.free)
        assert table.droppable(PG).in_eviction_order().tolist() == \
            [s for p in sorted(model.droppable) for s in model.droppable[p]]
        assert table.num_evictions == model.evictions
        assert table.droppable(PG).eviction_list_agrees()

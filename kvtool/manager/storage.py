"""Pools and slots: the memory behind the layout.

One pool per coalesced buffer, one pool list per pool group, pools placed one after another. The
same code builds the layout for allocated pools (bases are real addresses of torch uint8 tensors,
on CUDA when available) and for a virtual layout (bases are 2 MiB aligned offsets from 0).
"""

from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from kvtool.errors import LogicError, OutOfMemoryError, OutOfPagesError
from kvtool.manager.layer_groups import LayerGroupSpec
from kvtool.manager.layout import (
    KvCacheLayerGroupLayout,
    KvCacheLayout,
    KvCacheRegion,
    PoolGroupLayout,
    PoolLayout,
)
from kvtool.manager.pool_groups import PoolGroupSpec, place_pools
from kvtool.manager.slot_order import Fifo, SlotOrder
from kvtool.types import MemAddress, PageIndex, PoolIndex
from kvtool.units import format_size


class SlotAllocator:
    """Free list of one pool group's slots: freeing appends; allocation takes what `order` says
    (the head by default), after any slots `hand_out_first` put first.

    Invariant: every slot is either in the free list or owned, never both, never twice.

    In the default (FIFO) order the free list is kept as the slots never handed out (`_next_fresh`
    and above, in order: the head of the list until they run out) followed by the freed ones (a
    deque): a pool of millions of slots costs nothing until it is used, and ownership is one byte a
    slot. Other orders (kvtool validate's small pools) hold the whole free list in the deque.
    """

    def __init__(self, num_slots: int, order: SlotOrder | None = None) -> None:
        self.num_slots = num_slots
        self._order = order or Fifo()
        self._owned = bytearray(num_slots)
        self._first: list[PageIndex] = []
        """Free slots handed out before the order applies, last one first."""
        self._lazy = self._order.name == "fifo"
        self._next_fresh = 0 if self._lazy else num_slots
        self._freed: deque[PageIndex] = deque() if self._lazy else self._order.initial(num_slots)

    @property
    def num_free(self) -> int:
        return self.num_slots - self._next_fresh + len(self._freed)

    def allocate(self) -> PageIndex:
        if not self.num_free:
            raise OutOfPagesError("no free slot")
        slot = self._take_lazily(1)[0] if self._lazy and not self._first else self._take()
        self._owned[slot] = 1
        return PageIndex(int(slot))

    def allocate_many(self, count: int) -> np.ndarray:
        """The next `count` slots (int64), as `count` calls of `allocate` would hand them out."""
        return self.allocate_run(count)[0]

    def allocate_run(self, count: int) -> tuple[np.ndarray, slice | None]:
        """`allocate_many`, and the slice the slots fill when they are consecutive and ascending
        (slots never used before are): a constant written to a slice costs far less than to a
        list of slots."""
        if count > self.num_free:
            raise OutOfPagesError(f"{count} slots asked, {self.num_free} free" if count > 1 else "no free slot")
        run = None
        if self._lazy and not self._first:
            first_fresh = self._next_fresh
            slots = self._take_lazily(count)
            if count and self._next_fresh - first_fresh == count:   # all never used: one range
                run = slice(first_fresh, self._next_fresh)
        else:
            slots = np.array([self._take() for _ in range(count)], dtype=np.int64)
        self._owned_bytes()[slots if run is None else run] = 1
        return slots, run

    def _take_lazily(self, count: int) -> np.ndarray:
        fresh = min(count, self.num_slots - self._next_fresh)
        slots = np.arange(self._next_fresh, self._next_fresh + fresh, dtype=np.int64)
        self._next_fresh += fresh
        if fresh == count:
            return slots
        popleft = self._freed.popleft
        return np.concatenate((slots, np.array([popleft() for _ in range(count - fresh)], dtype=np.int64)))

    def _take(self) -> PageIndex:
        if self._first:
            slot = self._first.pop()
            self._freed.remove(slot)
            return slot
        return self._order.take(self._freed)

    def free(self, slot: PageIndex) -> None:
        if not 0 <= slot < self.num_slots or not self._owned[slot]:
            raise LogicError(f"slot {slot} freed but not owned")
        self._owned[slot] = 0
        self._freed.append(slot)

    def free_many(self, slots: np.ndarray) -> None:
        """`free` of each slot, in order."""
        if not len(slots):
            return
        owned = self.owned_mask()
        if slots.min() < 0 or slots.max() >= self.num_slots or not owned[slots].all() or \
                len(np.unique(slots)) != len(slots):
            raise LogicError("a slot freed but not owned")
        self._owned_bytes()[slots] = 0
        self._freed.extend(slots.tolist())

    def hand_out_last_first(self, count: int) -> None:
        """Make the next `count` allocations take the highest slots (kvtool validate keeps a canary
        there, because a connector that indexes with BAD_PAGE_INDEX writes slot -1, the last one)."""
        self.hand_out_first(sorted(self.free_slots())[-count:] if count else [])

    def hand_out_first(self, slots: list[PageIndex]) -> None:
        """Make the next allocations take these free `slots`, in this order, before the order
        applies (kvtool validate: exactly the slots a failure released, to a sentinel)."""
        self._freed = deque(self.free_slots())    # the never-used slots join the deque, in order
        self._next_fresh = self.num_slots
        self._first = list(reversed(slots))   # popped from the end

    def owned(self) -> set[PageIndex]:
        return cast(set[PageIndex], set(np.flatnonzero(self.owned_mask()).tolist()))

    def owned_mask(self) -> np.ndarray:
        """A read-only boolean per slot: owned."""
        return np.frombuffer(self._owned, dtype=np.bool_)

    def _owned_bytes(self) -> np.ndarray:
        """The ownership bytes themselves, one uint8 a slot (this allocator's own use)."""
        return np.frombuffer(self._owned, dtype=np.uint8)

    def free_slot_parts(self) -> tuple[range, np.ndarray]:
        """The free list as the never-used slots (a range, at its head in FIFO order) and the rest."""
        freed = np.fromiter(self._freed, dtype=np.int64, count=len(self._freed))
        return range(self._next_fresh, self.num_slots), freed

    def free_slots(self) -> list[PageIndex]:
        return [*range(self._next_fresh, self.num_slots), *self._freed]  # type: ignore[list-item]


@dataclass(frozen=True)
class Pools:
    """Bases and tensors of every pool, indexed [pool group][pool]."""

    bases: tuple[tuple[MemAddress, ...], ...]
    tensors: tuple[tuple[torch.Tensor, ...], ...] | None


def virtual_pools(pool_groups: tuple[PoolGroupSpec, ...], num_slots: list[int]) -> Pools:
    """Pools at the offsets `place_pools` gives them (bases count from 0), with no memory behind them."""
    offsets, _ = place_pools(pool_groups, num_slots)
    return Pools(tuple(tuple(MemAddress(o) for o in group) for group in offsets), None)


def allocated_pools(pool_groups: tuple[PoolGroupSpec, ...], num_slots: list[int],
                    device: torch.device) -> Pools:
    """One uint8 tensor per pool on `device` (largest pool first inside each group); OutOfMemoryError,
    before allocating anything, when they cannot fit in the device's memory."""
    require_memory(sum(s * n for pg, n in zip(pool_groups, num_slots, strict=True) for s in pg.slot_sizes), device)
    tensors = tuple(
        tuple(torch.zeros(slot_size * slots, dtype=torch.uint8, device=device) for slot_size in pg.slot_sizes)
        for pg, slots in zip(pool_groups, num_slots, strict=True)
    )
    bases = tuple(tuple(MemAddress(t.data_ptr()) for t in group) for group in tensors)
    return Pools(bases, tensors)


def host_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memory_shortfall(num_bytes: int, device: torch.device) -> str | None:
    """`X needed, more than WHERE (Y)` when `num_bytes` exceed what `device` has (free GPU memory,
    or physical host memory); None when they fit. Callers add the options that would help."""
    if device.type == "cuda":
        available = torch.cuda.mem_get_info(device)[0]
        where = f"free memory on {device}"
    else:
        available = host_memory_bytes()
        where = "this machine's memory"
    if num_bytes <= available:
        return None
    return f"{format_size(num_bytes)} needed, more than {where} ({format_size(available)})"


def require_memory(num_bytes: int, device: torch.device) -> None:
    """OutOfMemoryError when `num_bytes` exceed what `device` has: a clear error instead of an
    allocator traceback, or a machine driven into swap."""
    shortfall = memory_shortfall(num_bytes, device)
    if shortfall:
        raise OutOfMemoryError(f"{shortfall}: lower --gpu-memory, --num-slots, --batch-bytes or the tokens per block")


def build_layout(groups: tuple[LayerGroupSpec, ...], pool_groups: tuple[PoolGroupSpec, ...],
                 num_slots: list[int], pools: Pools, tokens_per_block: int,
                 model_name: str = "", dtype_name: str = "") -> KvCacheLayout:
    """The layout of `groups` over `pools`: one region per pool of the group's pool group.

    A coalesced buffer fills its pool's slot, so the buffer ranges inside one pool are adjacent
    and form a single region whose size equals its stride.
    """
    pool_group_of = {lg: pg for pg in pool_groups for lg in pg.layer_group_ids}
    group_layouts = []
    for group in groups:
        pg = pool_group_of[group.layer_group_id]
        regions = tuple(
            KvCacheRegion(
                base=pools.bases[pg.pool_group_index][i], size=coalesced.size, stride=pg.slot_sizes[i],
                num_slots=num_slots[pg.pool_group_index], buffers=coalesced.buffer_ids,
                buffer_bytes=coalesced.buffer_bytes, buffer_specs=coalesced.specs,
                pool_group_index=pg.pool_group_index, pool_index=PoolIndex(i),
                storage=None if pools.tensors is None else pools.tensors[pg.pool_group_index][i],
            )
            for i, coalesced in enumerate(group.coalesced)
        )
        group_layouts.append(KvCacheLayerGroupLayout(group.layer_group_id, group.layer_ids, group.window_size,
                                                     regions, pg.pool_group_index, group.num_sink_tokens))
    pool_group_layouts = tuple(
        PoolGroupLayout(pg.pool_group_index, num_slots[pg.pool_group_index], pg.layer_group_ids,
                        tuple(PoolLayout(PoolIndex(i), pools.bases[pg.pool_group_index][i], size)
                              for i, size in enumerate(pg.slot_sizes)))
        for pg in pool_groups
    )
    return KvCacheLayout(tokens_per_block, tuple(group_layouts), pool_group_layouts, model_name, dtype_name,
                         is_virtual=pools.tensors is None)

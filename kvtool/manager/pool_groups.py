"""Pool groups, and how many slots each gets from a memory budget.

Layer groups with identical slot-size lists share one pool group: its slots back pages of any of
those layer groups, and a page index is a slot id inside the pool group.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtool.blocks import ceil_div
from kvtool.errors import OutOfMemoryError
from kvtool.manager.layer_groups import LayerGroupSpec
from kvtool.types import POOL_ALIGNMENT, LayerGroupId, PoolGroupIndex


@dataclass(frozen=True)
class PoolGroupSpec:
    pool_group_index: PoolGroupIndex
    slot_sizes: tuple[int, ...]
    layer_group_ids: tuple[LayerGroupId, ...]

    @property
    def slot_bytes(self) -> int:
        return sum(self.slot_sizes)


def plan_pool_groups(groups: tuple[LayerGroupSpec, ...]) -> tuple[PoolGroupSpec, ...]:
    """Merge layer groups by identical slot-size lists, in order of first appearance."""
    order: list[tuple[int, ...]] = []
    members: dict[tuple[int, ...], list[LayerGroupId]] = {}
    for group in groups:
        if group.slot_sizes not in members:
            order.append(group.slot_sizes)
            members[group.slot_sizes] = []
        members[group.slot_sizes].append(group.layer_group_id)
    return tuple(PoolGroupSpec(PoolGroupIndex(i), sizes, tuple(members[sizes]))
                 for i, sizes in enumerate(order))


def align_up(value: int, alignment: int = POOL_ALIGNMENT) -> int:
    return ceil_div(value, alignment) * alignment


def place_pools(pool_groups: tuple[PoolGroupSpec, ...],
                num_slots: list[int]) -> tuple[tuple[tuple[int, ...], ...], int]:
    """(offset of every pool [pool group][pool], end of the last pool): pools placed one after
    another, in pool group order and largest first inside a group, each at a 2 MiB aligned offset."""
    cursor, offsets = 0, []
    for pool_group, slots in zip(pool_groups, num_slots, strict=True):
        group_offsets = []
        for slot_size in pool_group.slot_sizes:
            cursor = align_up(cursor)
            group_offsets.append(cursor)
            cursor += slot_size * slots
        offsets.append(tuple(group_offsets))
    return tuple(offsets), cursor


def placed_bytes(pool_groups: tuple[PoolGroupSpec, ...], num_slots: list[int]) -> int:
    """Bytes the pools take when placed as `place_pools` places them."""
    return place_pools(pool_groups, num_slots)[1]


def pages_per_pool_group(groups: tuple[LayerGroupSpec, ...], pool_groups: tuple[PoolGroupSpec, ...],
                         num_tokens: int, tokens_per_block: int) -> list[int]:
    """Pages a sequence of `num_tokens` holds in each pool group: every live block of every layer
    group sharing it (stale blocks of windowed groups need none)."""
    by_id = {g.layer_group_id: g for g in groups}
    return [sum(by_id[g].num_live_blocks(num_tokens, tokens_per_block) for g in pg.layer_group_ids)
            for pg in pool_groups]


def slots_for_budget(groups: tuple[LayerGroupSpec, ...], pool_groups: tuple[PoolGroupSpec, ...],
                     memory_bytes: int, tokens_per_block: int, typical_tokens: int) -> list[int]:
    """Slots per pool group so that the pools fit `memory_bytes`.

    Memory is shared in proportion to what a request of `typical_tokens` tokens needs in each
    pool group: all its blocks for full attention, only the live window for sliding groups.
    Raises OutOfMemoryError when some pool group would get no slot at all.
    """
    pages = pages_per_pool_group(groups, pool_groups, typical_tokens, tokens_per_block)
    bytes_per_share = sum(p * pg.slot_bytes for p, pg in zip(pages, pool_groups, strict=True))
    scale = memory_bytes / bytes_per_share
    num_slots = [int(p * scale) for p in pages]
    while num_slots and min(num_slots) > 0 and placed_bytes(pool_groups, num_slots) > memory_bytes:
        scale *= 0.999
        num_slots = [int(p * scale) for p in pages]
    if not num_slots or min(num_slots) < 1:
        smallest = sum(pg.slot_bytes for pg in pool_groups)
        raise OutOfMemoryError(f"{memory_bytes} bytes cannot hold one slot per pool group "
                               f"(at least {smallest} bytes are needed)")
    return num_slots

"""The bundled V2 KV cache manager: storage, radix tree, pages, and per-request caches.

Bottom-up: model spec -> layer groups -> pool groups -> pools and slots -> layout; the radix
tree and page table sit on the slots; `KvCache` objects use pages. The GPU tier is the only
tier modelled: pages never migrate, so a registered address stays valid while a page lives.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kvtool.errors import UnsupportedTierError
from kvtool.manager.block_keys import ReuseScope, uint32_tokens
from kvtool.manager.config import KvCacheManagerConfig
from kvtool.manager.kv_cache import CacheContext, KvCache, Match
from kvtool.manager.layer_groups import plan_layer_groups
from kvtool.manager.layout import KvCacheLayout
from kvtool.manager.pages import Page, PageTable
from kvtool.manager.pool_groups import plan_pool_groups, slots_for_budget
from kvtool.manager.radix_tree import NO_SLOT, RadixTree
from kvtool.manager.slot_order import slot_order
from kvtool.manager.storage import SlotAllocator, allocated_pools, build_layout, virtual_pools
from kvtool.types import BAD_PAGE_INDEX, DEFAULT_PRIORITY, CacheTier, LayerGroupId, PageIndex, PoolGroupIndex, Priority

POISON_BYTE = 0xA5
"""Every byte of a page when it is handed out: read back, it means the page was never written since."""
RELEASED_POISON_BYTE = 0xDE
"""Every byte of a page when it is freed: read back, it means the page was read after its release."""


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def plan_num_slots(config: KvCacheManagerConfig) -> list[int]:
    """Slots per pool group for `config` (validated first)."""
    config.validate()
    groups = plan_layer_groups(config.model, config.tokens_per_block)
    pool_groups = plan_pool_groups(groups)
    if config.num_slots_by_pool_group is not None:
        return list(config.num_slots_by_pool_group)
    if config.num_slots is not None:
        return [config.num_slots] * len(pool_groups)
    assert config.memory_bytes is not None
    return slots_for_budget(groups, pool_groups, config.memory_bytes, config.tokens_per_block,
                            config.typical_tokens)


def compute_layout(config: KvCacheManagerConfig) -> KvCacheLayout:
    """The layout a manager built from `config` would have, without allocating (virtual bases)."""
    groups = plan_layer_groups(config.model, config.tokens_per_block)
    pool_groups = plan_pool_groups(groups)
    num_slots = plan_num_slots(config)
    return build_layout(groups, pool_groups, num_slots, virtual_pools(pool_groups, num_slots),
                        config.tokens_per_block, config.model.shard_name, config.model.dtype.name)


class KvCacheManager:
    def __init__(self, config: KvCacheManagerConfig) -> None:
        if config.tiers != (CacheTier.GPU,):
            raise UnsupportedTierError("the bundled manager models the GPU tier only; set host cache size "
                                       "and disk cache size to 0")
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        self.layer_groups = plan_layer_groups(config.model, config.tokens_per_block)
        self.pool_groups = plan_pool_groups(self.layer_groups)
        self.num_slots = plan_num_slots(config)
        self.device = torch.device(config.device) if config.device else default_device()
        self.page_log: list[tuple] | None = None
        """When a list, every byte operation on a page (poison, copy) is appended to it."""
        pools = virtual_pools(self.pool_groups, self.num_slots) if config.virtual else \
            allocated_pools(self.pool_groups, self.num_slots, self.device)
        self.layout = build_layout(self.layer_groups, self.pool_groups, self.num_slots, pools,
                                   config.tokens_per_block, config.model.shard_name, config.model.dtype.name)
        self.tree = RadixTree(config.tokens_per_block, len(self.layer_groups), max(self.num_slots) + 1024)
        pool_group_of = {lg: pg.pool_group_index for pg in self.pool_groups for lg in pg.layer_group_ids}
        self.page_table = PageTable([SlotAllocator(n, slot_order(config.slot_order, config.slot_order_seed + i))
                                     for i, n in enumerate(self.num_slots)], pool_group_of, self.tree)
        self.page_table.keep_reusable = config.keep_reusable_pages
        if config.poison_new_pages:
            # Freed slots too: a connector that still reads a page after it was released (a save
            # one pass late) then saves poison, which a later load reveals, instead of stale bytes
            # that might happen to be right.
            self.page_table.on_allocate = self._poison
            self.page_table.on_free = self._poison_released
        self._caches: dict[int, KvCache] = {}
        self._holds: dict[int, PageHold] = {}
        self._cache_context = CacheContext(self.page_table, self.tree, self.layer_groups, self.tokens_per_block,
                                           self.copy_page, self._forget, config.swa_scratch_reuse)

    @property
    def model(self):
        return self.config.model

    # ---- requests ----------------------------------------------------------------------------
    def create_kv_cache(self, cache_id: object, input_tokens: Sequence[int] = (),
                        reuse_scope: ReuseScope = ReuseScope(), expected_prompt_length: int | None = None,
                        priority: Priority = DEFAULT_PRIORITY) -> KvCache:
        """A SUSPENDED cache holding the longest usable prefix of `input_tokens` found in the tree."""
        match = self.match(input_tokens, reuse_scope)
        cache = KvCache(self._cache_context, cache_id, reuse_scope, match, input_tokens, expected_prompt_length,
                        priority)
        self._caches[id(cache)] = cache
        return cache

    def match(self, tokens: Sequence[int], scope: ReuseScope = ReuseScope()) -> Match:
        """Longest prefix of `tokens` that every layer group can use; no side effect.

        A match of m tokens is usable when every layer group has pages for the blocks it still
        needs at history m: all blocks for full attention, sink blocks and the trailing window
        for windowed groups. A match may end inside a block (partial reuse, copied on write).
        """
        tpb = self.tokens_per_block
        root = self.tree.find_root(scope)
        if root is None:
            return Match()
        path = self.tree.find_chain(root, uint32_tokens(tokens))
        node = int(path[-1]) if len(path) else root
        rest = tokens[len(path) * tpb:(len(path) + 1) * tpb]
        partial = self.tree.best_partial(node, rest) if len(rest) else None
        if partial and self._usable(Match(path, partial[0], partial[1])):
            return Match(path, partial[0], partial[1])
        # Shorter matches are built only as they are tried: with full attention the first one is
        # usable, and building every prefix of a long path up front costs O(blocks^2).
        return next(m for m in (Match(path[:k]) for k in range(len(path), -1, -1)) if self._usable(m))

    def _usable(self, match: Match) -> bool:
        blocks = match.nodes if match.partial is None else np.append(match.nodes, match.partial)
        if not len(blocks):
            return True
        length = match.num_tokens(self.tokens_per_block)
        for group in self.layer_groups:
            stale = group.stale_range(length, self.tokens_per_block)
            missing = self.tree.pages[blocks, group.layer_group_id] == NO_SLOT
            missing[stale.start:stale.stop] = False
            if missing.any():
                return False
        return True

    def hold_pages(self, cache: KvCache) -> PageHold:
        """Keep every page of `cache`'s page lists alive (HELD) after it closes, until the hold is
        released."""
        slots: dict[PoolGroupIndex, list[np.ndarray]] = {}
        for group in self.layer_groups:
            pages = cache.page_slots(group.layer_group_id)
            slots.setdefault(self.page_table.pool_group_of(group.layer_group_id), []).append(
                pages[pages != BAD_PAGE_INDEX])
        hold = PageHold(self, {pg: np.concatenate(parts) for pg, parts in slots.items()})
        self._holds[id(hold)] = hold
        return hold

    def _poison(self, page: Page) -> None:
        self.poison_slot(page.layer_group_id, page.slot)

    def _poison_released(self, page: Page) -> None:
        self.poison_slot(page.layer_group_id, page.slot, RELEASED_POISON_BYTE)

    def poison_slot(self, layer_group_id: LayerGroupId, slot: PageIndex, byte: int = POISON_BYTE) -> None:
        """Fill one page's bytes with `byte` (POISON_BYTE when handed out, RELEASED_POISON_BYTE when
        freed) in every region of its layer group."""
        if self.page_log is not None:
            self.page_log.append(("poison", int(layer_group_id), int(slot), byte))
        if self.layout.is_virtual:
            return
        for region in self.layout.group(layer_group_id).regions:
            region.as_tensor()[slot].fill_(byte)

    def copy_page(self, layer_group_id: LayerGroupId, src: PageIndex, dst: PageIndex) -> None:
        if self.page_log is not None:
            self.page_log.append(("copy", int(layer_group_id), int(src), int(dst)))
        if self.layout.is_virtual:
            return
        for region in self.layout.group(layer_group_id).regions:
            view = region.as_tensor()
            view[dst].copy_(view[src])

    def replay_page_ops(self, ops: list[tuple]) -> None:
        """Apply another manager's `page_log` to these pools (a rank mirroring rank 0's byte
        operations on its own shard: poisoning and copy-on-write)."""
        for op in ops:
            if op[0] == "poison":
                self.poison_slot(LayerGroupId(op[1]), PageIndex(op[2]), *op[3:4])
            else:
                self.copy_page(LayerGroupId(op[1]), PageIndex(op[2]), PageIndex(op[3]))

    # ---- introspection -----------------------------------------------------------------------
    @property
    def caches(self) -> list[KvCache]:
        return list(self._caches.values())

    @property
    def holds(self) -> list[PageHold]:
        return list(self._holds.values())

    def num_free_slots(self, pool_group_index: int) -> int:
        return self.page_table.allocators[pool_group_index].num_free

    def num_droppable(self, pool_group_index: int) -> int:
        return self.page_table.num_droppable(PoolGroupIndex(pool_group_index))

    def evict_reusable(self) -> int:
        """Drop every reusable page no request uses (what memory pressure would do, at once): the
        local cache forgets those prefixes. Returns the number of pages evicted."""
        return sum(self.page_table.evict_all(pg.pool_group_index) for pg in self.pool_groups)

    def _forget(self, cache: KvCache) -> None:
        self._caches.pop(id(cache), None)

    def _forget_hold(self, hold: PageHold) -> None:
        self._holds.pop(id(hold), None)


class PageHold:
    """Pages kept alive past their cache's close (an asynchronous save in flight): one held user
    of each."""

    def __init__(self, manager: KvCacheManager, slots: dict[PoolGroupIndex, np.ndarray]) -> None:
        self._manager = manager
        self.slots = slots
        """Slots per pool group, in the order they are released."""
        for pool_group, held in slots.items():
            manager.page_table.acquire(pool_group, held, active=False)

    def release(self) -> None:
        """Let the pages go; idempotent."""
        for pool_group, held in self.slots.items():
            self._manager.page_table.release(pool_group, held, active=False)
        self.slots = {}
        self._manager._forget_hold(self)

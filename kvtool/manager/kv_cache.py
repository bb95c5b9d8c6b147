"""The per-request KV cache: its pages per layer group, history and committed tokens.

Status: SUSPENDED (new, or suspended) -> ACTIVE (after `resume`) -> CLOSED.
Invariant: num_committed_tokens <= history_length <= capacity; at creation all three equal the
reused length. A page list is an array of slots, one per block ordinal in
[0, ceil(capacity / tpb)), with BAD_PAGE_INDEX where a block has no page (stale blocks of windowed
groups); the pages' counts and tree links are the page table's cells.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtool.blocks import ceil_div
from kvtool.errors import LogicError
from kvtool.group_pages import GroupPages
from kvtool.manager.block_keys import ReuseScope, token_array, uint32_tokens
from kvtool.manager.layer_groups import LayerGroupSpec
from kvtool.manager.page_cells import NO_NODE, PageCells
from kvtool.manager.pages import PageTable
from kvtool.manager.radix_tree import NO_SLOT, RadixTree
from kvtool.types import BAD_PAGE_INDEX, KvCacheStatus, LayerGroupId, PageIndex, PoolGroupIndex, Priority

_BAD = int(BAD_PAGE_INDEX)
_NO_PAGES = np.zeros(0, dtype=np.int64)
_NO_NODES = np.zeros(0, dtype=np.int64)

@dataclass
class Match:
    """A prefix found in the tree: full blocks reused as they are, then maybe part of one more."""

    nodes: np.ndarray = field(default_factory=lambda: _NO_NODES)
    """Radix tree node ids (int64), block 0 first."""
    partial: int | None = None
    num_partial_tokens: int = 0

    def num_tokens(self, tokens_per_block: int) -> int:
        return len(self.nodes) * tokens_per_block + self.num_partial_tokens


@dataclass
class _ResizePlan:
    releases: list[tuple[LayerGroupId, int, int]] = field(default_factory=list)
    """(layer group, block ordinal, slot) of pages to let go."""
    allocations: list[tuple[LayerGroupId, Sequence[int], bool]] = field(default_factory=list)
    """Runs of block ordinals (ascending) of one layer group to give pages, transient (scratch) or not."""
    copies: list[tuple[LayerGroupId, int, int]] = field(default_factory=list)
    """(layer group, block ordinal, slot) of shared partial pages to copy before writing."""


@dataclass(frozen=True)
class CacheContext:
    """What a per-request cache may touch of its manager, and nothing more."""

    page_table: PageTable
    tree: RadixTree
    layer_groups: tuple[LayerGroupSpec, ...]
    tokens_per_block: int
    copy_page: Callable[[LayerGroupId, PageIndex, PageIndex], None]
    """Copy one page's bytes to another slot of the same layer group (copy-on-write)."""
    on_close: Callable[[KvCache], None]
    """Called once, when the cache closes, after its pages are released."""
    swa_scratch_reuse: bool
    """Whether new caches start with SWA scratch reuse on."""


class KvCache:
    def __init__(self, context: CacheContext, cache_id: object, scope: ReuseScope, match: Match,
                 tokens: Sequence[int], expected_prompt_length: int | None, priority: Priority) -> None:
        self._context = context
        self._table = context.page_table
        self._groups = context.layer_groups
        self.id = cache_id
        self.reuse_scope = scope
        self.tokens_per_block = context.tokens_per_block
        self.expected_prompt_length = expected_prompt_length
        self.priority = priority
        self._scratch_reuse = context.swa_scratch_reuse
        self._status = KvCacheStatus.SUSPENDED
        reused = match.num_tokens(self.tokens_per_block)
        prefix = tokens[:reused]   # an array's slice is a copy of its own, which the cache may keep
        self._committed = prefix if type(prefix) is array and prefix.itemsize == 4 and prefix.typecode in "IL" \
            else token_array(prefix)
        """Compact (4 bytes a token): a long prompt's cache holds its tokens once, as one buffer."""
        self._capacity = self._history = reused
        self._chain: list[np.ndarray] = [match.nodes]
        """The nodes this cache chains through (each the parent of the next), a run per commit."""
        self._num_nodes = len(match.nodes)
        self._pages: dict[LayerGroupId, np.ndarray] = {}
        """Slots (int64) per block ordinal, BAD_PAGE_INDEX where none."""
        self._pool_group = {g.layer_group_id: self._table.pool_group_of(g.layer_group_id) for g in self._groups}
        self._cells: dict[LayerGroupId, PageCells] = {gid: self._table.cells(pg)
                                                      for gid, pg in self._pool_group.items()}
        self._shared_partial: dict[LayerGroupId, int] = {}
        """Slot of a partial block still shared read-only with the tree, per layer group."""
        self._scratch_idle: dict[LayerGroupId, list[int]] = {g.layer_group_id: [] for g in self._groups}
        """Scratch slots this cache holds but no block uses now."""
        self._snapshot: GroupPages | None = None
        """`page_indices_by_group` until the pages change (resize, close)."""
        self._adopt_match(match, reused)

    # ---- state -------------------------------------------------------------------------------
    @property
    def status(self) -> KvCacheStatus:
        return self._status

    @property
    def is_active(self) -> bool:
        return self._status is KvCacheStatus.ACTIVE

    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def history_length(self) -> int:
        return self._history

    @property
    def num_committed_tokens(self) -> int:
        return len(self._committed)

    @property
    def committed_tokens(self) -> list[int]:
        return list(self._committed)

    @property
    def scratch_reuse(self) -> bool:
        """Whether blocks that go stale within the prompt may take transient scratch slots."""
        return self._scratch_reuse

    @property
    def num_blocks(self) -> int:
        return ceil_div(self._capacity, self.tokens_per_block)

    def get_page_indices(self, layer_group_id: int) -> list[PageIndex]:
        """One entry per block ordinal; BAD_PAGE_INDEX where the block has no page in this group."""
        self._require_open("get_page_indices")
        return self._pages[LayerGroupId(layer_group_id)].tolist()

    def page_indices_by_group(self) -> GroupPages:
        """`get_page_indices` of every layer group, position = group id (an immutable snapshot)."""
        self._require_open("page_indices_by_group")
        if self._snapshot is None:
            self._snapshot = GroupPages(tuple(self._pages[g].tolist()) for g in sorted(self._pages))
        return self._snapshot

    def page_slots(self, layer_group_id: int) -> np.ndarray:
        """A copy of the group's page list (slots, BAD_PAGE_INDEX where none), also once closed (empty)."""
        return self._pages[LayerGroupId(layer_group_id)].copy()

    def scratch_slots(self, layer_group_id: int) -> list[int]:
        """Scratch slots this cache holds in the group that no block uses now."""
        return list(self._scratch_idle[LayerGroupId(layer_group_id)])

    def check_invariant(self) -> None:
        """Raise LogicError unless committed <= history <= capacity and page lists fit capacity."""
        if not self.num_committed_tokens <= self._history <= self._capacity:
            raise LogicError(f"cache {self.id}: need num_committed_tokens ({self.num_committed_tokens}) <= "
                             f"history_length ({self._history}) <= capacity ({self._capacity})")
        for group in self._groups:
            pages = self._pages[group.layer_group_id]
            if self._status is not KvCacheStatus.CLOSED and len(pages) != self.num_blocks:
                raise LogicError(f"cache {self.id}: layer group {group.layer_group_id} lists {len(pages)} "
                                 f"pages for {self.num_blocks} blocks")
            stale = group.stale_range(self._history, self.tokens_per_block)
            missing = [j for j in np.flatnonzero(pages == _BAD).tolist() if j not in stale]
            if missing:
                raise LogicError(f"cache {self.id}: layer group {group.layer_group_id} has no page for "
                                 f"live block {missing[0]}")

    # ---- life cycle --------------------------------------------------------------------------
    def resume(self) -> bool:
        """SUSPENDED -> ACTIVE. Pages never leave the GPU tier here, so this always succeeds."""
        if self._status is not KvCacheStatus.SUSPENDED:
            raise LogicError(f"cache {self.id}: resume needs SUSPENDED, status is {self._status.value}")
        for pool_group, slots in self._slots_by_pool_group().items():
            self._table.set_active(pool_group, slots, True)
        self._status = KvCacheStatus.ACTIVE
        return True

    def suspend(self) -> None:
        """ACTIVE -> SUSPENDED: pages stay, but are HELD instead of LOCKED."""
        self._require_active("suspend")
        for pool_group, slots in self._slots_by_pool_group().items():
            self._table.set_active(pool_group, slots, False)
        self._status = KvCacheStatus.SUSPENDED

    def close(self) -> None:
        """Release every page (a trailing partial committed block joins the tree as a leaf)."""
        if self._status is KvCacheStatus.CLOSED:
            return
        active = self._status is KvCacheStatus.ACTIVE
        self._commit_partial_leaf()
        for pool_group, slots in self._slots_last_block_first().items():
            self._table.release(pool_group, slots, active)
        for gid, idle in self._scratch_idle.items():
            self._table.release(self._pool_group[gid], np.array(idle, dtype=np.int64), active)
        self._pages = {g: _NO_PAGES for g in self._pages}
        self._snapshot = None
        self._scratch_idle = {g: [] for g in self._scratch_idle}
        self._shared_partial.clear()
        tree = self._context.tree
        if self._num_nodes:
            tree.num_users[np.concatenate(self._chain)] -= 1   # a cache chains through a node once
            # Each node of the chain is the parent of the next: only the last may be a leaf, and
            # pruning it prunes up the chain as far as nothing holds a node.
            tree.prune(self._last_node())
        self._chain, self._num_nodes = [], 0
        self._status = KvCacheStatus.CLOSED
        self._context.on_close(self)

    def _slots_last_block_first(self) -> dict[PoolGroupIndex, np.ndarray]:
        """Every block's pages per pool group, later blocks first and, within a block, in layer
        group order (released first, so they are evicted first)."""
        if len(self._pages) == 1:
            (gid, pages), = self._pages.items()
            return {self._pool_group[gid]: pages[::-1][pages[::-1] != _BAD]}
        gids = list(self._pages)
        num = max(len(pages) for pages in self._pages.values())
        table = np.full((num, len(gids)), _BAD, dtype=np.int64)
        for column, pages in enumerate(self._pages.values()):
            table[:len(pages), column] = pages
        order = table[::-1].reshape(-1)
        pool_groups = np.tile(np.array([self._pool_group[g] for g in gids]), num)
        live = order != _BAD
        order, pool_groups = order[live], pool_groups[live]
        return {PoolGroupIndex(pg): order[pool_groups == pg] for pg in dict.fromkeys(pool_groups.tolist())}

    def _slots_by_pool_group(self) -> dict[PoolGroupIndex, np.ndarray]:
        """Every page this cache uses (listed or idle scratch), per pool group; no order promised."""
        by_pool_group: dict[PoolGroupIndex, list[np.ndarray]] = {}
        for gid, pages in self._pages.items():
            parts = by_pool_group.setdefault(self._pool_group[gid], [])
            parts += [pages[pages != _BAD], np.array(self._scratch_idle[gid], dtype=np.int64)]
        return {pg: np.concatenate(parts) for pg, parts in by_pool_group.items()}

    # ---- resize ------------------------------------------------------------------------------
    def resize(self, capacity: int, history_length: int | None = None, *, scratch_reuse: bool = True) -> bool:
        """Set capacity (and raise history); False, with nothing changed, when pages run out.

        Refuses (LogicError) to run unless ACTIVE, to decrease history, or to raise history above
        capacity. Stale blocks at the new history get no page; pages of blocks that became stale
        are released. With SWA scratch reuse on, blocks that will be stale when the prompt ends
        take transient scratch slots instead of pages of their own. `scratch_reuse=False` turns
        it off for this cache from this call on, for good: a caller reserving blocks that
        something outside the model will write (a connector's load) needs real pages for them.
        """
        self._require_active("resize")
        self._scratch_reuse = self._scratch_reuse and scratch_reuse
        history = self._history if history_length is None else history_length
        if history < self._history:
            raise LogicError(f"cache {self.id}: resize would decrease history_length "
                             f"from {self._history} to {history}")
        if history > capacity:
            raise LogicError(f"cache {self.id}: history_length {history} above capacity {capacity}")
        plan = self._plan_resize(capacity, history)
        if not self._plan_fits(plan):
            return False
        self._apply(plan, ceil_div(capacity, self.tokens_per_block))
        self._capacity, self._history = capacity, history
        return True

    def _plan_resize(self, capacity: int, history: int) -> _ResizePlan:
        plan = _ResizePlan()
        tpb = self.tokens_per_block
        num_new = ceil_div(capacity, tpb)
        for group in self._groups:
            gid = group.layer_group_id
            stale = group.stale_range(history, tpb)
            transient = self._transient_blocks(group)
            blocks = self._blocks_to_plan(group, self._pages[gid], num_new, capacity)
            num_pages = len(self._pages[gid])
            if type(blocks) is range and blocks.start >= num_pages and not stale and not transient:
                if len(blocks):   # the usual growth: new blocks past the end, all given pages
                    plan.allocations.append((gid, blocks, False))
                continue
            pages = self._pages[gid].tolist()
            for j in blocks:
                page = pages[j] if j < num_pages else _BAD
                if j >= num_new or j in stale:
                    if page != _BAD:
                        plan.releases.append((gid, j, page))
                elif page == _BAD:
                    is_transient = j in transient
                    last = plan.allocations[-1] if plan.allocations else None
                    if last is not None and last[0] == gid and last[2] == is_transient and isinstance(last[1], list):
                        last[1].append(j)
                    else:
                        plan.allocations.append((gid, [j], is_transient))
                elif self._shared_partial.get(gid) == page and capacity > self._capacity:
                    plan.copies.append((gid, j, page))
        return plan

    def _blocks_to_plan(self, group: LayerGroupSpec, pages: np.ndarray, num_new: int, capacity: int) -> Iterable[int]:
        """The block ordinals a resize may change. A full-attention group never has a hole below
        its length, so only the blocks between the old and the new length (and a shared partial
        page to copy) can change: a resize by one token costs O(1), not O(blocks)."""
        if group.window_size is not None:
            return range(max(len(pages), num_new))
        low = min(len(pages), num_new)
        span = range(low, max(len(pages), num_new))
        partial = self._shared_partial.get(group.layer_group_id)
        if partial is None or capacity <= self._capacity:
            return span
        at = int(np.flatnonzero(pages == partial)[0])
        return [at, *span] if at < low else span

    def _transient_blocks(self, group: LayerGroupSpec) -> range:
        if not self._scratch_reuse or group.window_size is None or not self.expected_prompt_length:
            return range(0, 0)
        return group.stale_range(self.expected_prompt_length, self.tokens_per_block)

    def _plan_fits(self, plan: _ResizePlan) -> bool:
        needed: dict[PoolGroupIndex, int] = {}
        ring = {g: len(p) for g, p in self._scratch_idle.items()}
        for gid, _, slot in plan.releases:
            cells = self._cells[gid]
            if cells.is_scratch[slot]:
                ring[gid] += 1
            elif cells.num_active[slot] + cells.num_held[slot] == 1:
                pg = self._pool_group[gid]
                needed[pg] = needed.get(pg, 0) - 1
        for gid, ordinals, transient in plan.allocations:
            count = len(ordinals)
            if transient:
                from_ring = min(count, ring[gid])
                ring[gid] -= from_ring
                count -= from_ring
            pg = self._table.pool_group_of(gid)
            needed[pg] = needed.get(pg, 0) + count
        for gid, _, _ in plan.copies:
            pg = self._table.pool_group_of(gid)
            needed[pg] = needed.get(pg, 0) + 1
        return all(n <= self._table.num_available(pg) for pg, n in needed.items())

    def _apply(self, plan: _ResizePlan, num_blocks: int) -> None:
        old = self._snapshot
        lengths = {gid: len(pages) for gid, pages in self._pages.items()}
        if not (plan.releases or plan.copies or plan.allocations) and all(n == num_blocks for n in lengths.values()):
            return   # a decode step inside its last block: the page lists, and their snapshot, stay
        self._snapshot = None
        self._apply_changes(plan, num_blocks)
        if old is not None and not (plan.releases or plan.copies) and \
                all(ordinals[0] >= lengths[gid] for gid, ordinals, _ in plan.allocations):
            # Pages only appended: the snapshot grows by the new tail instead of being rebuilt from
            # every block (a long request's decode would otherwise cost O(blocks) a new block).
            self._snapshot = GroupPages(old[i] + tuple(self._pages[gid][lengths[gid]:].tolist())
                                        for i, gid in enumerate(sorted(self._pages)))

    def _apply_changes(self, plan: _ResizePlan, num_blocks: int) -> None:
        self._apply_releases(plan.releases)
        for gid, pages in self._pages.items():
            if len(pages) > num_blocks:
                self._pages[gid] = pages[:num_blocks].copy()
            elif len(pages) < num_blocks:
                self._pages[gid] = np.concatenate((pages, np.full(num_blocks - len(pages), _BAD, dtype=np.int64)))
        for gid, j, shared in plan.copies:
            private = self._table.allocate(gid, active=True)
            self._context.copy_page(gid, PageIndex(shared), PageIndex(private))
            self._pages[gid][j] = private
            del self._shared_partial[gid]
            self._table.release(self._pool_group[gid], np.array([shared]), active=True)
        for gid, ordinals, transient in plan.allocations:
            pages, idle = self._pages[gid], self._scratch_idle[gid]
            if transient:
                for j in ordinals:
                    pages[j] = idle.pop() if idle else self._table.allocate(gid, active=True, is_scratch=True)
            elif type(ordinals) is range:
                pages[ordinals.start:ordinals.stop] = self._table.allocate_many(gid, len(ordinals), active=True)
            else:
                pages[list(ordinals)] = self._table.allocate_many(gid, len(ordinals), active=True)

    def _apply_releases(self, releases: list[tuple[LayerGroupId, int, int]]) -> None:
        """Blocks that lose their page: a scratch page goes idle, any other is released (in plan order)."""
        released: dict[PoolGroupIndex, list[int]] = {}
        for gid, j, slot in releases:
            self._pages[gid][j] = _BAD
            if self._shared_partial.get(gid) == slot:
                del self._shared_partial[gid]
            if self._cells[gid].is_scratch[slot]:
                self._scratch_idle[gid].append(slot)
            else:
                released.setdefault(self._pool_group[gid], []).append(slot)
        for pool_group, slots in released.items():
            self._table.release(pool_group, np.array(slots, dtype=np.int64), active=True)

    # ---- commit ------------------------------------------------------------------------------
    def commit(self, tokens: Sequence[int]) -> None:
        """Append computed tokens; full blocks join the tree and history rises to the committed length."""
        self._require_active("commit")
        if self.num_committed_tokens + len(tokens) > self._capacity:
            raise LogicError(f"cache {self.id}: committing {len(tokens)} tokens past capacity {self._capacity}")
        self._committed.extend(tokens if type(tokens) is array and tokens.typecode == self._committed.typecode
                               else token_array(tokens))
        self._history = max(self._history, self.num_committed_tokens)
        tpb = self.tokens_per_block
        first, end = self._num_nodes, self.num_committed_tokens // tpb
        if first >= end:
            return
        tree = self._context.tree
        parent = self._last_node() if self._num_nodes else tree.root(self.reuse_scope)
        # A view of the committed tokens, let go before they next grow (an exported buffer cannot).
        chain = tree.extend(parent, uint32_tokens(self._committed)[first * tpb:end * tpb])
        for group in self._groups:
            pages = self._pages[group.layer_group_id][first:end]
            if group.window_size is None and (tree.pages[chain, group.layer_group_id] == NO_SLOT).all():
                # Full attention, nodes without a page: each of these blocks has a page of its own,
                # in no node yet (a shared partial page was copied when the cache first grew).
                self._table.attach(group.layer_group_id, pages, chain, self.priority)
            else:
                self._attach_pages(group.layer_group_id, pages, chain)
        tree.num_users[chain] += 1
        self._chain.append(chain)
        self._num_nodes += len(chain)

    def _last_node(self) -> int:
        return int(next(run[-1] for run in reversed(self._chain) if len(run)))

    def _attach_pages(self, gid: LayerGroupId, slots: np.ndarray, nodes: np.ndarray) -> None:
        """Let the tree hold these pages of consecutive blocks as the nodes' pages of layer group
        `gid`, where a page is in no node yet, is not scratch and the node has none for `gid`."""
        cells = self._cells[gid]
        joins = (slots != _BAD) & (self._context.tree.pages[nodes, gid] == NO_SLOT)
        candidates = slots[joins]
        joins[joins] = (cells.node[candidates] == NO_NODE) & ~cells.is_scratch[candidates]
        if joins.any():
            self._table.attach(gid, slots[joins], nodes[joins], self.priority)

    def _commit_partial_leaf(self) -> None:
        """A trailing partial block joins the tree as a leaf (pruned at once when it holds nothing)."""
        tpb = self.tokens_per_block
        num_full = self.num_committed_tokens // tpb
        if self.num_committed_tokens % tpb and self._num_nodes == num_full:
            tree = self._context.tree
            parent = self._last_node() if self._num_nodes else tree.root(self.reuse_scope)
            tokens = self._committed[num_full * tpb:]
            node = tree.get_or_insert(parent, tokens)
            for gid, pages in self._pages.items():
                if num_full < len(pages):
                    self._attach_pages(gid, pages[num_full:num_full + 1], np.array([node], dtype=np.int64))
            tree.prune(node)

    # ---- helpers -----------------------------------------------------------------------------
    def _adopt_match(self, match: Match, reused: int) -> None:
        tpb = self.tokens_per_block
        tree = self._context.tree
        blocks = match.nodes if match.partial is None else np.append(match.nodes, match.partial)
        if len(match.nodes):
            tree.num_users[match.nodes] += 1
        for group in self._groups:
            gid = group.layer_group_id
            stale = group.stale_range(reused, tpb)
            pages = tree.pages[blocks, gid].astype(np.int64)
            pages[stale.start:stale.stop] = _BAD
            self._table.acquire_tree_pages(gid, pages[pages != _BAD] if stale else pages)
            self._pages[gid] = pages
            if match.partial is not None and len(pages) and pages[-1] != _BAD:
                self._shared_partial[gid] = int(pages[-1])

    def _require_active(self, what: str) -> None:
        if self._status is not KvCacheStatus.ACTIVE:
            raise LogicError(f"cache {self.id}: {what} needs ACTIVE, status is {self._status.value}")

    def _require_open(self, what: str) -> None:
        if self._status is KvCacheStatus.CLOSED:
            raise LogicError(f"cache {self.id}: {what} on a closed cache")

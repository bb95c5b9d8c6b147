"""The radix tree of committed blocks, one root per reuse scope, as arrays indexed by node id.

A node is one block: its tokens, its parent, and at most one page (slot) per layer group. Full
blocks are interior nodes; a partial block (fewer tokens than a block) may only be a leaf. A node
stays while it holds a page, has children, or some cache chains through it (its users).

A block is its parent's one child holding exactly its tokens: a prompt is matched by walking
down from its scope's root, comparing tokens, so a match is exact (no hash stands for the tokens).
Blocks committed together get consecutive ids, each the only child of the one before; a walk
that found block i at node n checks whether n+1, n+2, ... hold the next blocks with one array
comparison, so a prefix of thousands of blocks costs a lookup among a node's children per run
of blocks committed together, not one per block. A node with many children lists them by first
token as well.

The tree of a long trace holds millions of blocks, so a node is a row of numpy arrays, not an
object: its tokens in one uint32 row, its parent, its children as a doubly linked list (newest
first), counts and page slots as int32 cells: about 160 bytes a block of 32 tokens. Whole prompts
are looked up, added and pruned with array operations. The arrays are zeroed lazily up to the
expected number of nodes (the pages' slots), so rows never used cost no memory, and only grow past it.
Node ids are reused once pruned; a caller holds an id only while the node is alive (a cache
chaining through a node keeps it alive).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from kvtool.errors import LogicError
from kvtool.manager.block_keys import ReuseScope, unpack_tokens
from kvtool.manager.growable import grow_rows, lazy_zeros

NO_NODE = -1
NO_SLOT = -1
"""`pages` cell of a layer group where the node holds no page."""
_FREE = 0
"""`num_tokens` of an unused id (a live node has at least one token; a root counts as full)."""

WIDE_NODE = 8
"""Children a node has before they are also listed by their first token."""
_CHECK_CHUNK = 1 << 19
_SAMPLED = 1 << 10
"""Live blocks `structure_problem` looks up among their parents' children (evenly spaced; all of
them in a small tree)."""
_FIRST_RUN = 64
"""Blocks checked at once after a block found among its parent's children (doubling while all match)."""


class RadixTree:
    def __init__(self, tokens_per_block: int, num_layer_groups: int = 1, expected_nodes: int = 1024) -> None:
        self.tokens_per_block = tokens_per_block
        self.num_layer_groups = num_layer_groups
        rows = max(expected_nodes, 16)
        self._roots: dict[ReuseScope, int] = {}
        self._num_alive = 0
        self.parent = lazy_zeros(rows, np.int32)
        self.num_tokens = lazy_zeros(rows, np.int16)   # at most MAX_TOKENS_PER_BLOCK
        self.depth = lazy_zeros(rows, np.int32)
        """Blocks from the root (a root is 0): an evicted page's block ordinal, without a walk up."""
        self.num_users = lazy_zeros(rows, np.int32)
        self.num_children = lazy_zeros(rows, np.int32)
        self._first_child = lazy_zeros(rows, np.int32)
        self._next_sibling = lazy_zeros(rows, np.int32)
        self._prev_sibling = lazy_zeros(rows, np.int32)
        self.tokens = lazy_zeros((rows, tokens_per_block), np.uint32)
        self.pages = lazy_zeros((rows, num_layer_groups), np.int32)
        """Slot of each node's page per layer group (NO_SLOT: none); the page table writes it."""
        self._heads: dict[int, dict[int, list[int]]] = {}
        """Children of a node with more than WIDE_NODE, by first token, in insertion order."""
        self._free_ids: list[int] = []
        self._next_id = 0

    # ---- reading -----------------------------------------------------------------------------
    def __len__(self) -> int:
        """Nodes alive, roots included."""
        return self._num_alive

    def is_full(self, node: int) -> bool:
        return int(self.num_tokens[node]) == self.tokens_per_block

    def block_ordinal(self, node: int) -> int:
        """The block's position in its prompt (its depth below the root, less one)."""
        return int(self.depth[node]) - 1

    def block_tokens(self, node: int) -> tuple[int, ...]:
        return unpack_tokens(self.tokens[node, :self.num_tokens[node]].astype("<u4").tobytes())

    def children(self, node: int) -> list[int]:
        """In insertion order."""
        out, child = [], int(self._first_child[node])
        while child != NO_NODE:
            out.append(child)
            child = int(self._next_sibling[child])
        return out[::-1]

    def nodes(self) -> Iterator[int]:
        """Every live node, roots included (no order promised)."""
        return iter(self.node_ids().tolist())

    def node_ids(self) -> np.ndarray:
        return np.flatnonzero(self.num_tokens[:self._next_id] != _FREE)

    def node_id_chunks(self, size: int) -> Iterator[np.ndarray]:
        """Every live node, a chunk of at most `size` ids at a time (int32)."""
        for start in range(0, self._next_id, size):
            ids = np.arange(start, min(start + size, self._next_id), dtype=np.int32)
            yield ids[self.num_tokens[ids] != _FREE]

    def is_alive(self, node: int) -> bool:
        return 0 <= node < len(self.num_tokens) and int(self.num_tokens[node]) != _FREE

    def describe(self, node: int) -> str:
        pages = [g for g in range(self.num_layer_groups) if self.pages[node, g] != NO_SLOT]
        return f"node {node} (block {self.block_ordinal(node)}, tokens={int(self.num_tokens[node])}, pages={pages})"

    def structure_problem(self) -> str | None:
        """What is wrong with the tree's own bookkeeping, in words (None: nothing): parents are
        live full blocks one level up, child counts equal the nodes naming each parent, sibling
        lists are linked both ways from their parent's first child, wide nodes list exactly their
        children, the roots are the parentless nodes, and a block is the one child of its parent
        holding its tokens (a sample of them looked up). A chunk at a time: millions of nodes in
        little memory."""
        alive = self.num_tokens[:self._next_id] != _FREE
        children = 0
        for start in range(0, self._next_id, _CHECK_CHUNK):
            ids = np.flatnonzero(alive[start:start + _CHECK_CHUNK]) + start
            problem = self._links_problem(ids, alive)
            if problem:
                return problem
            children += int(self.num_children[ids].sum())
        # Counted without a counter a node: no leaf claims a child, and the counts add up to the
        # nodes that have a parent.
        if children != int(alive.sum()) - len(self._roots):
            return "a node's child count disagrees with the nodes naming it their parent"
        roots = set(np.flatnonzero(alive & (self.parent[:self._next_id] == NO_NODE)).tolist())
        if roots != set(self._roots.values()):
            return "the roots listed are not the parentless nodes"
        if int(alive.sum()) != self._num_alive:
            return "the count of live nodes is wrong"
        for node, by_token in self._heads.items():
            listed = [child for same in by_token.values() for child in same]
            if sorted(listed) != sorted(self.children(node)) or \
                    any(int(self.tokens[c, 0]) != t for t, same in by_token.items() for c in same):
                return f"wide node {node} lists other children by first token than it has"
        return self._lookup_problem(alive)

    def _links_problem(self, ids: np.ndarray, alive: np.ndarray) -> str | None:
        parents = self.parent[ids].astype(np.int64)
        inner, above = ids[parents != NO_NODE], parents[parents != NO_NODE]
        if ((above < 0) | (above >= self._next_id)).any() or not alive[above].all() or \
                (self.num_tokens[above] != self.tokens_per_block).any() or \
                (self.depth[inner] != self.depth[above] + 1).any() or (self.depth[ids[parents == NO_NODE]] != 0).any():
            return "a node's parent is not a live full block one level up"
        before, after = self._prev_sibling[inner].astype(np.int64), self._next_sibling[inner].astype(np.int64)
        first = before == NO_NODE
        if (self._first_child[above[first]] != inner[first]).any() or \
                (self._next_sibling[before[~first]] != inner[~first]).any() or \
                (self.parent[before[~first]] != above[~first]).any() or \
                (self._prev_sibling[after[after != NO_NODE]] != inner[after != NO_NODE]).any():
            return "a sibling list is not linked both ways from its parent's first child"
        if ((self.num_children[ids] == 0) != (self._first_child[ids] == NO_NODE)).any():
            return "a node's child count disagrees with the nodes naming it their parent"
        return None

    def _lookup_problem(self, alive: np.ndarray) -> str | None:
        blocks = np.flatnonzero(alive & (self.parent[:self._next_id] != NO_NODE))
        for node in blocks[::max(1, len(blocks) // _SAMPLED)].tolist():
            width = int(self.num_tokens[node])
            if self._child_holding(int(self.parent[node]), self.tokens[node, :width]) != node:
                return f"node {node} is not the one child of its parent holding its tokens"
        return None

    # ---- roots and lookups -------------------------------------------------------------------
    def root(self, scope: ReuseScope) -> int:
        node = self._roots.get(scope)
        if node is None:
            node = int(self._new_ids(1)[0])
            self._init_rows(node, NO_NODE, 0, self.tokens_per_block)
            self._roots[scope] = node
        return node

    def find_root(self, scope: ReuseScope) -> int | None:
        return self._roots.get(scope)

    def find_chain(self, parent: int, tokens: np.ndarray) -> np.ndarray:
        """Node ids of the longest run of `tokens`' full blocks (uint32; a trailing partial block is
        ignored) that the tree holds below `parent`, block 0 first."""
        tpb = self.tokens_per_block
        count = len(tokens) // tpb
        blocks = tokens[:count * tpb].reshape(count, tpb)
        runs: list[np.ndarray] = []
        at, below = 0, parent
        while at < count:
            node = self._child_holding(below, blocks[at])
            if node == NO_NODE:
                break
            length = 1 + self._run_after(node, blocks[at + 1:])
            runs.append(np.arange(node, node + length, dtype=np.int64))
            at += length
            below = node + length - 1
        return np.concatenate(runs) if runs else np.zeros(0, dtype=np.int64)

    def _run_after(self, node: int, blocks: np.ndarray) -> int:
        """How many of `blocks` (rows of tokens, in order) are the nodes node+1, node+2, ...: each a
        live full block that is the child of the one before and holds its row's tokens."""
        tpb = self.tokens_per_block
        limit = min(len(blocks), self._next_id - node - 1)
        matched, window = 0, _FIRST_RUN
        while matched < limit:
            size = min(window, limit - matched)
            first = node + 1 + matched
            rows = slice(first, first + size)
            same = self.parent[rows] == np.arange(first - 1, first + size - 1)
            same &= self.num_tokens[rows] == tpb
            same &= (self.tokens[rows] == blocks[matched:matched + size]).all(axis=1)
            if not same.all():
                return matched + int(np.argmin(same))
            matched, window = matched + size, 2 * window
        return matched

    def _child_holding(self, parent: int, tokens: np.ndarray | Sequence[int]) -> int:
        """The child of `parent` holding exactly `tokens` (1 .. tokens_per_block of them); NO_NODE
        when none (there is at most one: a block is never added twice)."""
        width = len(tokens)
        heads = self._heads.get(parent)
        candidates = heads.get(int(tokens[0]), []) if heads is not None else self.children(parent)
        if not candidates:
            return NO_NODE
        ids = np.array(candidates, dtype=np.int64)
        same = (self.num_tokens[ids] == width) & (self.tokens[ids, :width] == np.asarray(tokens)).all(axis=1)
        hit = np.flatnonzero(same)
        return int(ids[hit[0]]) if len(hit) else NO_NODE

    def best_partial(self, parent: int, chunk: Sequence[int]) -> tuple[int, int] | None:
        """The child sharing the longest token prefix with `chunk` (at most a block), if any: the
        first inserted among equals. A whole-block match is a full match, not a partial one."""
        if not len(chunk):
            return None
        heads = self._heads.get(parent)
        candidates = heads.get(int(chunk[0]), []) if heads is not None else self.children(parent)
        if not candidates:
            return None
        ids = np.array(candidates, dtype=np.int64)   # insertion order: argmax takes the first inserted
        width = len(chunk)
        equal = self.tokens[ids, :width] == np.asarray(chunk, dtype=np.uint32)
        equal &= np.arange(width) < self.num_tokens[ids][:, None]
        common = np.where(equal.all(axis=1), width, np.argmin(equal, axis=1))
        if width == self.tokens_per_block:
            common[(common == width) & (self.num_tokens[ids] == width)] = 0
        best = int(np.argmax(common))
        return (int(ids[best]), int(common[best])) if common[best] else None

    # ---- growing -----------------------------------------------------------------------------
    def get_or_insert(self, parent: int, tokens: Sequence[int]) -> int:
        """The child of `parent` holding exactly `tokens` (1 .. tokens_per_block of them), inserted
        when missing. Partial blocks become leaves."""
        if not self.is_full(parent):
            raise LogicError("a partial block cannot have children")
        values = np.asarray(tokens, dtype=np.uint32)
        node = self._child_holding(parent, values)
        if node != NO_NODE:
            return node
        node = int(self._new_ids(1)[0])
        self._init_rows(node, parent, int(self.depth[parent]) + 1, len(values))
        self.tokens[node, :len(values)] = values
        self._link(parent, node)
        return node

    def extend(self, parent: int, tokens: np.ndarray) -> np.ndarray:
        """`get_or_insert` of the consecutive full blocks of `tokens` (uint32; a trailing partial
        block is ignored), each the child of the one before: the chain's node ids. Past the first
        block the tree does not know, every block is new (a new node has no children), so they are
        made at once, with consecutive ids: a prefill commits thousands of blocks."""
        tpb = self.tokens_per_block
        count = len(tokens) // tpb
        if not count:
            return np.zeros(0, dtype=np.int64)
        if not self.is_full(parent):
            raise LogicError("a partial block cannot have children")
        # Blocks chain: a first block unknown means all are (the usual prefill).
        known = self.find_chain(parent, tokens) if self._child_holding(parent, tokens[:tpb]) != NO_NODE \
            else np.zeros(0, dtype=np.int64)
        first = len(known)
        if first == count:
            return known
        below = int(known[-1]) if first else parent
        num_reused = min(count - first, len(self._free_ids))
        new = self._new_ids(count - first)
        parents = np.concatenate(([below], new[:-1]))
        # Fresh ids are consecutive: rows written as slices, much cheaper than fancy indexing.
        consecutive = len(new) == 1 or not num_reused
        rows = slice(int(new[0]), int(new[-1]) + 1) if consecutive else new
        but_last = slice(int(new[0]), int(new[-1])) if consecutive else new[:-1]
        self._init_rows(rows, parents, int(self.depth[below]) + 1 + np.arange(len(new)), tpb)
        self.tokens[rows] = tokens[first * tpb:count * tpb].reshape(-1, tpb)
        # Each new block is the only child of the one before it.
        self._first_child[but_last] = new[1:]
        self.num_children[but_last] = 1
        self._link(below, int(new[0]))
        return np.concatenate((known, new))

    def _new_ids(self, count: int) -> np.ndarray:
        """`count` unused ids (int64): pruned ones first, then fresh ones (consecutive)."""
        reused = self._free_ids[len(self._free_ids) - min(count, len(self._free_ids)):]
        del self._free_ids[len(self._free_ids) - len(reused):]
        fresh = np.arange(self._next_id, self._next_id + count - len(reused), dtype=np.int64)
        self._next_id += len(fresh)
        self._num_alive += count
        if self._next_id > len(self.num_tokens):
            self._grow(self._next_id)
        return np.concatenate((np.array(reused, dtype=np.int64), fresh)) if reused else fresh

    def _grow(self, rows: int) -> None:
        for name in ("parent", "num_tokens", "depth", "num_users", "num_children", "_first_child", "_next_sibling",
                     "_prev_sibling", "tokens", "pages"):
            grow_rows(getattr(self, name), rows)

    def _init_rows(self, ids: np.ndarray | slice | int, parent, depth, num_tokens: int) -> None:
        """A new node's row (rows are zero until first used, and cleared when pruned)."""
        self.parent[ids] = parent
        self.depth[ids] = depth
        self.num_tokens[ids] = num_tokens
        self.num_users[ids] = 0
        self.num_children[ids] = 0
        self._first_child[ids] = NO_NODE
        self._next_sibling[ids] = NO_NODE
        self._prev_sibling[ids] = NO_NODE
        self.pages[ids] = NO_SLOT

    def _link(self, parent: int, child: int) -> None:
        """Add `child` to `parent`'s children (the linked list's head is the newest)."""
        first = int(self._first_child[parent])
        self._next_sibling[child] = first
        self._prev_sibling[child] = NO_NODE
        if first != NO_NODE:
            self._prev_sibling[first] = child
        self._first_child[parent] = child
        count = int(self.num_children[parent]) + 1
        self.num_children[parent] = count
        heads = self._heads.get(parent)
        if heads is not None:
            heads.setdefault(int(self.tokens[child, 0]), []).append(child)
        elif count > WIDE_NODE:
            heads = self._heads[parent] = {}
            for each in self.children(parent):
                heads.setdefault(int(self.tokens[each, 0]), []).append(each)

    # ---- pruning -----------------------------------------------------------------------------
    def prune(self, node: int) -> None:
        """Remove `node` and then its ancestors while each holds nothing and nobody chains through it."""
        if self.num_children[node] or self.num_users[node] or int(self.pages[node].max()) != NO_SLOT:
            return   # the usual case (it holds a page), told without the arrays of prune_many
        self.prune_many(np.array([node], dtype=np.int64))

    def prune_many(self, nodes: np.ndarray) -> None:
        """`prune` of each node (the result does not depend on their order)."""
        candidates = np.asarray(nodes, dtype=np.int64)
        removed: list[np.ndarray] = []
        while len(candidates):
            candidates = np.unique(candidates[self._prunable(candidates)])   # usually none: no sort
            if not len(candidates):
                break
            removed.append(candidates)
            self.num_tokens[candidates] = _FREE   # gone: a parent's cascade sees it as not alive
            parents = self.parent[candidates].astype(np.int64)
            parents = parents[parents != NO_NODE]
            np.subtract.at(self.num_children, parents, 1)
            candidates = np.unique(parents)
        if removed:
            self._remove(np.concatenate(removed))

    def _prunable(self, nodes: np.ndarray) -> np.ndarray:
        return ((self.num_tokens[nodes] != _FREE) & (self.num_children[nodes] == 0) &
                (self.num_users[nodes] == 0) & (self.pages[nodes] == NO_SLOT).all(axis=1))

    def _remove(self, gone: np.ndarray) -> None:
        """Forget pruned nodes: unlink those whose parent stays, free every id."""
        parents = self.parent[gone].astype(np.int64)
        staying = (parents != NO_NODE) & (self.num_tokens[np.maximum(parents, 0)] != _FREE)
        for node, parent in zip(gone[staying].tolist(), parents[staying].tolist(), strict=True):
            self._unlink(parent, node)
        roots = set(gone[parents == NO_NODE].tolist())
        if roots:
            self._roots = {scope: node for scope, node in self._roots.items() if node not in roots}
        if self._heads:
            wide = np.fromiter(self._heads, dtype=np.int64, count=len(self._heads))
            for node in wide[np.isin(wide, gone)].tolist():
                del self._heads[node]
        self.num_tokens[gone] = _FREE
        self._num_alive -= len(gone)
        self._free_ids.extend(gone.tolist())

    def _unlink(self, parent: int, child: int) -> None:
        before, after = int(self._prev_sibling[child]), int(self._next_sibling[child])
        if before == NO_NODE:
            self._first_child[parent] = after
        else:
            self._next_sibling[before] = after
        if after != NO_NODE:
            self._prev_sibling[after] = before
        heads = self._heads.get(parent)
        if heads is not None:
            head = int(self.tokens[child, 0])
            same = heads[head]
            same.remove(child)
            if not same:
                del heads[head]


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n

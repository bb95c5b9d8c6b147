"""The radix tree of committed blocks, one root per reuse scope.

A node is one block: its chained key, its tokens, and at most one page per layer group. Full
blocks are interior nodes; a partial block (fewer tokens than a block) may only be a leaf.
A node stays while it holds a page, has children, or some cache chains through it.

A node keeps its tokens packed (4-byte little-endian, as `tokens_bytes` packs them, the bytes its
key was hashed from): a tree of millions of blocks holds 4 bytes a token instead of a tuple of
int objects (about 36 bytes a token), and a partial match compares bytes.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from kvtool.errors import LogicError
from kvtool.manager.block_keys import ReuseScope, root_key, tokens_bytes, unpack_tokens
from kvtool.types import LayerGroupId


class RadixNode:
    __slots__ = ("key", "parent", "packed", "is_full", "children", "heads", "pages", "num_users", "depth")

    def __init__(self, key: bytes, parent: "RadixNode | None", packed: bytes, is_full: bool) -> None:
        self.key = key
        self.parent = parent
        self.packed = packed
        """The block's tokens, packed by `tokens_bytes`."""
        self.is_full = is_full
        self.children: dict[bytes, RadixNode] = {}
        self.heads: dict[bytes, list[RadixNode]] | None = None
        """Once the node has more than WIDE_NODE children: its children by their first packed
        token, in insertion order (a partial match looks only at those sharing it)."""
        self.pages: dict[LayerGroupId, Any] = {}
        """The page table's pages holding this block, per layer group; opaque to the tree."""
        self.num_users = 0
        self.depth: int = 0 if parent is None else parent.depth + 1

    @property
    def block_ordinal(self) -> int:
        return self.depth - 1

    @property
    def tokens(self) -> tuple[int, ...]:
        return unpack_tokens(self.packed)

    def __repr__(self) -> str:
        return f"RadixNode(block={self.block_ordinal}, tokens={len(self.packed) // 4}, pages={sorted(self.pages)})"


class RadixTree:
    def __init__(self, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self._roots: dict[bytes, RadixNode] = {}

    def root(self, scope: ReuseScope) -> RadixNode:
        key = root_key(scope)
        if key not in self._roots:
            self._roots[key] = RadixNode(key, None, b"", True)
        return self._roots[key]

    def find_root(self, scope: ReuseScope) -> RadixNode | None:
        return self._roots.get(root_key(scope))

    def get_or_insert(self, parent: RadixNode, packed: bytes, key: bytes) -> RadixNode:
        """The child of `parent` with `key` (a block whose tokens `tokens_bytes` packed into
        `packed`), inserted when missing. Partial blocks become leaves."""
        if not parent.is_full:
            raise LogicError("a partial block cannot have children")
        node = parent.children.get(key)
        if node is None:
            node = RadixNode(key, parent, packed, len(packed) == 4 * self.tokens_per_block)
            parent.children[key] = node
            if parent.heads is not None:
                parent.heads.setdefault(packed[:4], []).append(node)
            elif len(parent.children) > WIDE_NODE:
                parent.heads = {}
                for child in parent.children.values():
                    parent.heads.setdefault(child.packed[:4], []).append(child)
        return node

    def extend(self, parent: RadixNode, packed: bytes, keys: list[bytes]) -> list[RadixNode]:
        """`get_or_insert` of consecutive full blocks (their tokens `packed` back to back, one key
        each; trailing bytes are ignored), each the child of the one before: the chain's nodes. Past the first block the tree
        did not know, every block is new (a new node has no children), so the rest are made
        without looking: a prefill commits thousands of blocks."""
        step, nodes = 4 * self.tokens_per_block, []
        i = 0
        while i < len(keys):
            known = parent.children.get(keys[i])
            parent = known if known is not None else self.get_or_insert(parent, packed[i * step:(i + 1) * step],
                                                                         keys[i])
            nodes.append(parent)
            i += 1
            if known is None:
                break
        for j in range(i, len(keys)):
            node = RadixNode(keys[j], parent, packed[j * step:(j + 1) * step], True)
            parent.children[keys[j]] = node
            nodes.append(node)
            parent = node
        return nodes

    def best_partial(self, parent: RadixNode, chunk: Sequence[int]) -> tuple[RadixNode, int] | None:
        """The child sharing the longest token prefix with `chunk` (shorter than a block), if any."""
        best: tuple[RadixNode, int] | None = None
        packed = tokens_bytes(chunk)
        candidates = parent.children.values() if parent.heads is None else parent.heads.get(packed[:4], ())
        for child in candidates:
            common = common_packed_prefix(child.packed, packed)
            if common == len(chunk) and child.is_full and len(chunk) == self.tokens_per_block:
                continue  # a whole-block match is a full match, not a partial one
            if common and (best is None or common > best[1]):
                best = (child, common)
        return best

    def prune(self, node: RadixNode) -> None:
        """Remove `node` and then its ancestors while each holds nothing and nobody chains through it."""
        while node.parent is not None and not node.pages and not node.children and node.num_users == 0:
            parent = node.parent
            del parent.children[node.key]
            if parent.heads is not None:
                _unlist_head(parent.heads, node)
            node.parent = None
            node = parent
        if node.parent is None and not node.children:
            self._roots.pop(node.key, None)

    def nodes(self) -> Iterator[RadixNode]:
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())


WIDE_NODE = 8
"""Children a node has before they are also listed by their first token."""


def _unlist_head(heads: dict[bytes, list[RadixNode]], node: RadixNode) -> None:
    same = heads[node.packed[:4]]
    same.remove(node)
    if not same:
        del heads[node.packed[:4]]


def common_packed_prefix(a: bytes, b: bytes) -> int:
    """How many leading tokens two `tokens_bytes` packings share."""
    if a[:4] != b[:4]:
        return 0   # the usual case (different blocks): no loop
    n = min(len(a), len(b)) // 4
    if a[:4 * n] == b[:4 * n]:
        return n
    low, high = 1, n   # a[:4*low] equal, a[:4*high] not: bisect on whole tokens
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if a[:4 * middle] == b[:4 * middle] else (low, middle)
    return low


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n

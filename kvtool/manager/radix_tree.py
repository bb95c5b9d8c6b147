"""The radix tree of committed blocks, one root per reuse scope.

A node is one block: its chained key, its tokens, and at most one page per layer group. Full
blocks are interior nodes; a partial block (fewer tokens than a block) may only be a leaf.
A node stays while it holds a page, has children, or some cache chains through it.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

from kvtool.errors import LogicError
from kvtool.manager.block_keys import ReuseScope, root_key
from kvtool.types import LayerGroupId


class RadixNode:
    __slots__ = ("key", "parent", "tokens", "is_full", "children", "pages", "num_users", "depth")

    def __init__(self, key: bytes, parent: "RadixNode | None", tokens: tuple[int, ...], is_full: bool) -> None:
        self.key = key
        self.parent = parent
        self.tokens = tokens
        self.is_full = is_full
        self.children: dict[bytes, RadixNode] = {}
        self.pages: dict[LayerGroupId, Any] = {}
        """The page table's pages holding this block, per layer group; opaque to the tree."""
        self.num_users = 0
        self.depth = 0 if parent is None else parent.depth + 1

    @property
    def block_ordinal(self) -> int:
        return self.depth - 1

    def __repr__(self) -> str:
        return f"RadixNode(block={self.block_ordinal}, tokens={len(self.tokens)}, pages={sorted(self.pages)})"


class RadixTree:
    def __init__(self, tokens_per_block: int) -> None:
        self.tokens_per_block = tokens_per_block
        self._roots: dict[bytes, RadixNode] = {}

    def root(self, scope: ReuseScope) -> RadixNode:
        key = root_key(scope)
        if key not in self._roots:
            self._roots[key] = RadixNode(key, None, (), True)
        return self._roots[key]

    def find_root(self, scope: ReuseScope) -> RadixNode | None:
        return self._roots.get(root_key(scope))

    def get_or_insert(self, parent: RadixNode, tokens: Sequence[int], key: bytes) -> RadixNode:
        """The child of `parent` with `key`, inserted when missing. Partial blocks become leaves."""
        if not parent.is_full:
            raise LogicError("a partial block cannot have children")
        node = parent.children.get(key)
        if node is None:
            node = RadixNode(key, parent, tuple(tokens), len(tokens) == self.tokens_per_block)
            parent.children[key] = node
        return node

    def best_partial(self, parent: RadixNode, chunk: Sequence[int]) -> tuple[RadixNode, int] | None:
        """The child sharing the longest token prefix with `chunk` (shorter than a block), if any."""
        best: tuple[RadixNode, int] | None = None
        for child in parent.children.values():
            common = common_prefix_length(child.tokens, chunk)
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


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
